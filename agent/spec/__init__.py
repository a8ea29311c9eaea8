"""Speculative decoding on the agent: proposers draft tokens for a fed row from the sequence's own
history (ngram.py), and verify.py accepts or rejects them against the target model's logits of
the same step, exactly (docs/protocol.md, "Speculative decoding")."""
from __future__ import annotations

from typing import Any

from agent.logits_dump import LogitsDump
from agent.spec.ngram import NgramProposer
from common.config import ServingConfig


def proposer_for(cfg: ServingConfig) -> Any:
    """The agent's n-gram proposer for speculative_config, or None: another method (a draft model:
    agent/spec/draft_load.py), off, or while the contest's precision files are written (they name a
    row's last token, which drafts would move)."""
    if cfg.spec_method != "ngram" or LogitsDump.from_env() is not None:
        return None
    return NgramProposer(cfg.spec_lookup_min, cfg.spec_lookup_max)
