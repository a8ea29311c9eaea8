"""What the key table (common/config_keys.py) says to people: `notices(doc)`, one line per key we
ignore, per value we cannot honour on this server and per unknown key (the server and `launch_agents`
print them as warnings at start), and docs/config.md's tables (`markdown`, checked by a test)."""
from __future__ import annotations

from typing import Any

from common.config_keys import IGNORED_SECTIONS, KEYS, SECTIONS
from common.config_values import BFLOAT16, FLOAT16, FLOAT32, INT8


def _value_notices(mc: dict[str, Any], sc: dict[str, Any]) -> list[str]:
    out = []
    if str(mc.get("batching_strategy", "continuous")).lower() != "continuous":
        out.append(f"model_config.batching_strategy {mc['batching_strategy']!r}: only continuous batching is served")
    if mc.get("page_attention", True) in (False, "False", "false"):
        out.append("model_config.page_attention False: the KV cache is always paged")
    if "model_dtype" in mc and str(mc["model_dtype"]).lower() not in FLOAT32 + INT8 + BFLOAT16 + FLOAT16 + ("gguf",):
        out.append(f"model_config.model_dtype {mc['model_dtype']!r}: the model runs in float32 on this server "
                   "(bfloat16, float16 and int8 are the other choices)")
    if mc.get("backend") not in (None, "", "mindspore"):
        out.append(f"model_config.backend {mc['backend']!r}: this server runs its own MindSpore graph-mode Llama")
    decode_wait = sc.get("decode_batch_waiting_time", mc.get("decode_batch_waiting_time", 0)) or 0
    if float(decode_wait) > 0:
        out.append(f"decode_batch_waiting_time {decode_wait}: decode steps never wait (a new request joins the "
                   "next step anyway); ignored")
    return out


def notices(doc: dict[str, Any]) -> list[str]:
    rows = {(k.section, k.key): k for k in KEYS}
    out = []
    for section, body in doc.items():
        if section in IGNORED_SECTIONS:
            out.append(f"{section}: ignored ({IGNORED_SECTIONS[section]})")
            continue
        if section == "model_path":  # the GE backend's graphs: config.load_config says what it does
            continue
        if section not in SECTIONS:
            out.append(f"unknown section {section!r}: ignored")
            continue
        for key in (body or {}):
            row = rows.get((section, key))
            if row is None:
                out.append(f"unknown key {section}.{key}: ignored")
            elif row.ignored:
                out.append(f"{section}.{key}: ignored ({row.ignored})")
    return out + _value_notices(doc.get("model_config") or {}, doc.get("serving_config") or {})


def markdown(section: str, defaults: Any) -> str:
    """docs/config.md's table of a section: key, the original's meaning, what it does here, default."""
    lines = ["| key | original meaning | here | default |", "|---|---|---|---|"]
    for k in KEYS:
        if k.section != section:
            continue
        here = f"ignored ({k.ignored})" if k.ignored else k.here
        default = getattr(defaults, k.attr) if k.attr else None
        shown = "" if default is None or k.ignored else f"`{str(default).lower() if isinstance(default, bool) else default}`"
        lines.append(f"| `{k.key}` | {k.original} | {here} | {shown} |")
    return "\n".join(lines)
