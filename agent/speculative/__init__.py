"""Speculative decoding on the agent: a proposer (ngram.py; a draft model: draft_model.py) drafts
tokens for a fed row, and the Speculator (speculator.py) runs a step with drafts and verifies them
against the target model's logits of the same step, exactly (verify.py; docs/protocol.md,
"Speculative decoding"). Methods are rows of common/speculative.py."""
from __future__ import annotations

from importlib import import_module
from typing import Any

from agent.logits_dump import LogitsDump
from agent.runner_config import RunnerConfig
from agent.speculative.proposer import Proposer
from common.config import ServingConfig
from common.speculative import method_of


def load_proposer(cfg: ServingConfig, rc: RunnerConfig, vocab_size: int, tokenizer: Any) -> Proposer | None:
    """speculative_config's proposer, built by its method's row, or None: off, or while the contest's
    precision files are written (they name a row's last token, which drafts would move)."""
    m = method_of(cfg)
    if m is None or LogitsDump.from_env() is not None:
        return None
    module, name = m.proposer.split(":")
    return getattr(import_module(module), name)(cfg, rc, vocab_size, tokenizer)
