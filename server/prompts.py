"""A prompt (text or token ids) as token ids checked against the context, with its max_new_tokens
resolved: shared by the HTTP APIs and the offline API."""
from __future__ import annotations

from typing import Any

from common.config import ServingConfig
from server.sampling_params import InvalidRequest, SamplingParams
from common.tokenizer import TextTokenizer

# A prompt whose first max_model_len * 16 characters already make max_model_len tokens is refused
# without tokenising the rest (a 5 MB prompt: milliseconds instead of seconds of a worker thread).
PROBE_CHARS_PER_TOKEN = 16


def encode_prompt(tok: TextTokenizer, cfg: ServingConfig, text: Any, params: SamplingParams,
                  default_new: int | None = None) -> list[int]:
    """Token ids of a prompt, checked against the context; resolves the default max_new_tokens
    (`default_new`, or as many as fit). The HTTP side runs it in a worker thread.

    Two limits: the KV context (`decode_seq_length`: asking for more is an error) and the original's
    `max_generate_length` cap on prompt + output (a request simply ends there with "length")."""
    if isinstance(text, list) and len(text) >= cfg.max_total_tokens:  # before looking at any id
        raise InvalidRequest(f"prompt is {len(text)} tokens; the maximum is {cfg.max_total_tokens - 1}")
    if isinstance(text, list) and text and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        ids = text  # OpenAI and TGI accept token ids
    elif isinstance(text, str) and text:
        probe = text[:cfg.max_model_len * PROBE_CHARS_PER_TOKEN]
        if len(probe) < len(text) and len(tok.encode(probe)) >= cfg.max_model_len:
            raise InvalidRequest(f"prompt is more than {cfg.max_model_len - 1} tokens, the maximum")
        try:
            ids = tok.encode(text)
        except Exception:  # e.g. lone UTF-16 surrogates from a JSON escape
            raise InvalidRequest("the prompt could not be tokenised (invalid Unicode?)") from None
    else:
        raise InvalidRequest("the prompt must be a non-empty string")
    if any(t < 0 or t >= tok.vocab_size for t in ids):
        raise InvalidRequest("prompt token id out of range")
    room = cfg.max_total_tokens - len(ids)
    if room < 1:
        raise InvalidRequest(f"prompt is {len(ids)} tokens; the maximum is {cfg.max_total_tokens - 1}")
    if params.max_new_tokens is None:
        params.max_new_tokens = min(default_new or room, room)
    elif len(ids) + params.max_new_tokens > cfg.max_model_len:
        raise InvalidRequest(f"this model's maximum context length is {cfg.max_model_len} tokens; the request "
                             f"asks for {len(ids) + params.max_new_tokens} ({len(ids)} in the prompt, "
                             f"{params.max_new_tokens} to generate)")
    params.max_new_tokens = min(params.max_new_tokens, room)
    return ids
