"""What each key of the original llm-serving YAML means here (docs/config.md says the same in prose).

`notices(doc)` returns one line per key we ignore, per value we cannot honour on this server, and per
unknown key: the server and `launch_agents` print them as warnings at start.
"""
from __future__ import annotations

from typing import Any

# Keys read into ServingConfig (common/config.py), with the original's meaning.
HONOURED: dict[str, set[str]] = {
    "model_config": {"model_name", "model_path", "model_cfg_path", "max_generate_length", "end_token", "seq_length",
                     "vocab_size", "prefill_batch_size", "decode_batch_size", "batch_waiting_time",
                     "decode_batch_waiting_time", "batching_strategy", "page_attention", "model_dtype", "backend",
                     # ours
                     "quant_group_size", "kv_cache_dtype"},
    "serving_config": {"agent_ports", "agent_ip", "start_device_id", "server_ip", "server_port",
                       "prefill_batch_waiting_time", "decode_batch_waiting_time",
                       # ours
                       "max_queue", "max_num_batched_tokens", "prefill_only_tokens", "schedule_policy",
                       "step_timeout_s", "heartbeat_s", "max_agent_restarts", "recovery_deadline_s",
                       "max_body_bytes", "max_header_bytes", "http_header_timeout_s", "http_keepalive_timeout_s",
                       "warmup", "enable_prefix_caching", "overlap_steps", "request_log", "agent_cores", "curve_keys", "agent_hosts", "device",
                       "kv_cache_memory",
                       "compile_cache_dir"},
    "pa_config": {"num_blocks", "block_size", "decode_seq_length"},
    "tokenizer": {"vocab_file", "path"},
}

# Keys accepted and not needed here, with why.
IGNORED: dict[tuple[str, str | None], str] = {
    ("model_config", "zactivate_len"): "no graph depends on the context length (token-packed steps)",
    ("model_config", "model_type"): "one static graph per token bucket, all built before ready",
    ("model_config", "seq_type"): "one static graph per token bucket, all built before ready",
    ("model_config", "current_index"): "positions travel with every token",
    ("model_config", "pad_token_id"): "padding never reaches the model's outputs",
    ("tokenizer", "type"): "the tokenizer is read from vocab_file or the model's own files",
    ("basic_inputs", None): "model inputs are built by the agent",
    ("extra_inputs", None): "model inputs are built by the agent",
    ("warmup_inputs", None): "warm-up builds every graph shape itself",
}
FLOAT32 = ("float32", "fp32", "datatype.float32", "mstype.float32")
INT8 = ("int8", "w8a8", "datatype.int8", "mstype.int8")
BFLOAT16 = ("bfloat16", "bf16", "datatype.bfloat16", "mstype.bfloat16")
FLOAT16 = ("float16", "fp16", "half", "datatype.float16", "mstype.float16")


def _value_notices(mc: dict[str, Any], sc: dict[str, Any]) -> list[str]:
    out = []
    if str(mc.get("batching_strategy", "continuous")).lower() != "continuous":
        out.append(f"model_config.batching_strategy {mc['batching_strategy']!r}: only continuous batching is served")
    if mc.get("page_attention", True) in (False, "False", "false"):
        out.append("model_config.page_attention False: the KV cache is always paged")
    if "model_dtype" in mc and str(mc["model_dtype"]).lower() not in FLOAT32 + INT8 + BFLOAT16 + FLOAT16:
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
    out = []
    for section, body in doc.items():
        if (section, None) in IGNORED:
            out.append(f"{section}: ignored ({IGNORED[(section, None)]})")
            continue
        if section not in HONOURED:
            out.append(f"unknown section {section!r}: ignored")
            continue
        for key in (body or {}):
            if (section, key) in IGNORED:
                out.append(f"{section}.{key}: ignored ({IGNORED[(section, key)]})")
            elif key not in HONOURED[section]:
                out.append(f"unknown key {section}.{key}: ignored")
    return out + _value_notices(doc.get("model_config") or {}, doc.get("serving_config") or {})
