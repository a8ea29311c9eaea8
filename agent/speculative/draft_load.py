"""The draft model of `self_int8` and `draft` (agent/speculative/draft_model.py), loaded beside the target:
its own weights, graphs and KV cache, with the target's KV geometry and token buckets."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from agent.model.calibrate import CALIBRATION_TEXT
from agent.runner_config import RunnerConfig
from agent.speculative.draft_model import DraftModelProposer
from agent.tensor_parallel import Group
from agent.weights.load import load_model
from common.config import ConfigError, ServingConfig
from common.memory import ModelShape, draft_files
from common.model_files import ModelFiles, resolve_model
from common.speculative import draft_method
from common.tokenizer import load_tokenizer

log = logging.getLogger("llm_serving.agent")


def same_vocabulary(target: Any, draft: Any, vocab: int) -> str | None:
    """Why the draft's tokenizer is not the target's, or None."""
    if draft.vocab_size != target.vocab_size:
        return f"its tokenizer has {draft.vocab_size} tokens, the target's {target.vocab_size}"
    for i in range(min(vocab, target.vocab_size)):
        if draft.id_to_token(i) != target.id_to_token(i):
            return f"token {i} is {draft.id_to_token(i)!r} there and {target.id_to_token(i)!r} here"
    return None


def _draft_files(cfg: ServingConfig) -> tuple[ModelFiles, ModelShape]:
    return draft_files(cfg, resolve_model(cfg.model_path, cfg.model_cfg_path))


def draft_key(cfg: ServingConfig) -> str:
    """What the draft's graphs depend on (its shape and dtype), for the compile-cache key; "" for none."""
    m = draft_method(cfg)
    return f"{m.name}:{m.draft_dtype(cfg)}:{_draft_files(cfg)[1]}" if m is not None else ""


def load_draft(cfg: ServingConfig, rc: RunnerConfig, vocab_size: int, target_tok: Any) -> DraftModelProposer:
    """The draft proposer of a draft-model method (common/speculative.py); ConfigError (naming why) for
    a draft model whose vocabulary is not the target's."""
    from agent.runner import ModelRunner

    m = draft_method(cfg)
    files = _draft_files(cfg)[0]
    tok = target_tok if m.own_weights else load_tokenizer(files, None)
    dtype = m.draft_dtype(cfg)
    model_cfg, weights = load_model(files, cfg.max_model_len, int8=dtype == "int8")
    why = None if model_cfg.vocab_size == vocab_size else (
        f"its vocabulary has {model_cfg.vocab_size} rows, the target's {vocab_size}")
    why = why or (same_vocabulary(target_tok, tok, vocab_size) if tok is not target_tok else None)
    if why:
        raise ConfigError(f"speculative_config.draft_model_path {cfg.spec_draft_model}: {why}; a draft needs the "
                          "target's tokenizer")
    drc = replace(rc, model_dtype=dtype, lora=(0, 0), tp=Group())
    try:
        runner = ModelRunner(model_cfg, weights, drc, calibration=tok.encode(CALIBRATION_TEXT) if dtype == "int8" else None)
    except ValueError as exc:  # e.g. int8 drafts without the native kernels
        raise ConfigError(f"speculative_config.method = {cfg.spec_method}: its draft cannot run here: {exc}") from None
    log.info("speculative %s: draft %s (%d layers, hidden %d) in %s, %.0f MiB of weights, KV %.0f MiB",
             cfg.spec_method, files.path, model_cfg.num_layers, model_cfg.hidden_size, dtype,
             runner.model.weight_bytes / 2**20, runner.model.kv_cache_bytes / 2**20)
    return DraftModelProposer(runner, cfg.spec_method)
