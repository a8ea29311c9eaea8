"""Request-body parsing for the three APIs into SamplingParams (strict, with clear 4xx messages)."""
from __future__ import annotations

from typing import Any

from server.sampling_params import InvalidRequest, SamplingParams


def to_bool(v: Any, name: str) -> bool:
    """The original clients send booleans as strings ("True"/"False")."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
        return v.strip().lower() in ("true", "1")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise InvalidRequest(f"{name} must be a boolean")


def _num(d: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool):
        raise InvalidRequest(f"{key} must be a number")
    try:
        out = kind(v)  # numbers may arrive as strings from the original clients
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequest(f"{key} must be {'an integer' if kind is int else 'a number'}") from None
    if kind is int and isinstance(v, float) and v != out:
        raise InvalidRequest(f"{key} must be an integer")
    return out


def _stop_list(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise InvalidRequest("stop must be a string or a list of strings")


def _int_list(v: Any, name: str) -> list[int]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise InvalidRequest(f"{name} must be a list of integers")
    return v


def _top_k(d: dict[str, Any]) -> int:
    k = _num(d, "top_k", int, 0)
    return 0 if k == -1 else k  # vLLM's "off"


def tgi_params(p: Any, top_k: int = 0) -> tuple[SamplingParams, dict[str, Any]]:
    """`parameters` of the TGI API (and, with the original's defaults, of the original's).
    Returns params and output options."""
    if p is None:
        p = {}
    if not isinstance(p, dict):
        raise InvalidRequest("parameters must be an object")
    do_sample = to_bool(p.get("do_sample", False), "do_sample")
    sp = SamplingParams(
        max_new_tokens=_num(p, "max_new_tokens", int, None),
        temperature=_num(p, "temperature", float, 1.0),
        top_k=0 if p.get("top_k") == -1 else _num(p, "top_k", int, top_k),
        top_p=_num(p, "top_p", float, 1.0), min_p=_num(p, "min_p", float, 0.0),
        repetition_penalty=_num(p, "repetition_penalty", float, 1.0),
        presence_penalty=_num(p, "presence_penalty", float, 0.0),
        frequency_penalty=_num(p, "frequency_penalty", float, 0.0),
        seed=_num(p, "seed", int, None), stop=_stop_list(p.get("stop")),
        ignore_eos=to_bool(p.get("ignore_eos", False), "ignore_eos"),
        logprobs=_num(p, "top_n_tokens", int, 0) or 0,
        priority=_num(p, "priority", int, 0)).validate()
    if not do_sample:  # greedy; the sampling knobs were still checked above (a bad one is a 400 either way)
        sp.temperature, sp.top_k, sp.top_p, sp.min_p = 0.0, 0, 1.0, 0.0
    opts = {"return_full_text": to_bool(p.get("return_full_text", False), "return_full_text"),
            "details": to_bool(p.get("details", True), "details")}
    return sp, opts


ORIGINAL_TOP_K = 3  # the original's default top_k when sampling
ORIGINAL_MAX_NEW_TOKENS = 300


def original_params(p: Any) -> tuple[SamplingParams, dict[str, Any]]:
    """`parameters` of the original llm-serving API, with its defaults: top_k 3 when sampling,
    return_protocol "sse", return_full_text on (its request model's default: a stream ends with a
    line carrying the whole generated text), details off (max_new_tokens: ORIGINAL_MAX_NEW_TOKENS,
    applied with the prompt's length known)."""
    sp, opts = tgi_params(p, top_k=ORIGINAL_TOP_K)
    p = p or {}
    opts["return_full_text"] = to_bool(p.get("return_full_text", True), "return_full_text")
    protocol = p.get("return_protocol", "sse")
    if not isinstance(protocol, str):
        raise InvalidRequest("return_protocol must be a string")
    opts["return_protocol"] = protocol
    opts["details"] = to_bool(p.get("details", False), "details")
    return sp, opts


def openai_params(b: dict[str, Any], chat: bool) -> SamplingParams:
    if _num(b, "n", int, 1) != 1:
        raise InvalidRequest("only n=1 is supported")
    if b.get("best_of") not in (None, 1):
        raise InvalidRequest("best_of is not supported")
    if chat:
        want = b.get("logprobs", False)
        logprobs = _num(b, "top_logprobs", int, 0) if to_bool(want, "logprobs") else 0
        if to_bool(want, "logprobs") and not logprobs:
            logprobs = 1
    else:
        logprobs = _num(b, "logprobs", int, 0)
    max_tokens = b.get("max_completion_tokens", b.get("max_tokens"))
    return SamplingParams(
        max_new_tokens=_num({"max_tokens": max_tokens}, "max_tokens", int, None),
        temperature=_num(b, "temperature", float, 1.0), top_k=_top_k(b),
        top_p=_num(b, "top_p", float, 1.0), min_p=_num(b, "min_p", float, 0.0),
        repetition_penalty=_num(b, "repetition_penalty", float, 1.0),
        presence_penalty=_num(b, "presence_penalty", float, 0.0),
        frequency_penalty=_num(b, "frequency_penalty", float, 0.0),
        seed=_num(b, "seed", int, None), stop=_stop_list(b.get("stop")),
        stop_token_ids=_int_list(b.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=to_bool(b.get("ignore_eos", False), "ignore_eos"), logprobs=logprobs or 0,
        priority=_num(b, "priority", int, 0)).validate()


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(msgs: Any) -> list[dict[str, str]]:
    """OpenAI chat `messages` as {role, content} strings: content may be a string or a list of text
    parts (`[{"type": "text", "text": ...}]`); roles outside OpenAI's are refused."""
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    out = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
        if m["role"] not in CHAT_ROLES:
            raise InvalidRequest(f"unknown message role {m['role']!r} (one of {', '.join(CHAT_ROLES)})")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise InvalidRequest("content parts must be {\"type\": \"text\", \"text\": ...}; "
                                     "other part types are not supported")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise InvalidRequest("message content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out
