"""Speculative decoding's methods, one row each: every product file that asks "which method, and
what does it need?" reads this table (the config checks, the memory plan, the agent's loader and
the start log), so a method's name is written here and nowhere else."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from common.config import ServingConfig


@dataclass(frozen=True)
class SpecMethod:
    name: str
    proposer: str  # "module:function" on the agent that builds its proposer from (cfg, rc, vocab, tokenizer)
    draft_model: bool  # drafts with a model: its weights, graphs and KV beside the target's
    own_weights: bool  # that model is the served weights (quantised), not draft_model_path
    tensor_parallel: bool  # may run with tensor_parallel_size > 1
    says: Callable[["ServingConfig"], str]  # what it drafts from, for the start log

    def draft_dtype(self, cfg: "ServingConfig") -> str:
        """The draft model's dtype: the served weights run as int8; a separate draft as the target's."""
        return "int8" if self.own_weights else cfg.model_dtype


METHODS: dict[str, SpecMethod] = {m.name: m for m in (
    SpecMethod("ngram", "agent.speculative.ngram:from_config", False, False, True,
               lambda c: f"prompt lookup of {c.spec_lookup_min}-{c.spec_lookup_max} tokens"),
    SpecMethod("self_int8", "agent.speculative.draft_load:load_draft", True, True, False,
               lambda c: "the served weights in int8"),
    SpecMethod("draft", "agent.speculative.draft_load:load_draft", True, False, False,
               lambda c: f"the model at {c.spec_draft_model}"),
)}


def method_of(cfg: "ServingConfig") -> SpecMethod | None:
    """speculative_config's method row, or None (off; an unknown name is refused by the config checks)."""
    return METHODS.get(cfg.spec_method) if cfg.spec_method else None


def draft_method(cfg: "ServingConfig") -> SpecMethod | None:
    """The method's row where it drafts with a model, else None."""
    m = method_of(cfg)
    return m if m is not None and m.draft_model else None
