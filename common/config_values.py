"""How each serving YAML value is read (common/config_keys.py's `read`): the readers raise
ValueError/TypeError for a value they refuse, and WHAT names what each accepts, for the error."""
from __future__ import annotations

import enum

import re
from typing import Any


FLOAT32 = ("float32", "fp32", "datatype.float32", "mstype.float32")
INT8 = ("int8", "w8a8", "datatype.int8", "mstype.int8")
BFLOAT16 = ("bfloat16", "bf16", "datatype.bfloat16", "mstype.bfloat16")
FLOAT16 = ("float16", "fp16", "half", "datatype.float16", "mstype.float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")

# ------------------------------------------------------------ value readers (ValueError/TypeError: refused)
def as_bool(value: Any) -> bool:
    """YAML booleans, and the original clients' "True"/"False" strings (bool("False") is True)."""
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("true", "false"):
        return str(value).strip().lower() == "true"
    raise ValueError(value)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(value: Any) -> int:
    """A byte count: an integer, or a string such as "8GiB", "512 MiB", "20G" (G = GiB, as vLLM's)."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(value)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def as_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(value)
    return int(value)


def as_group(value: Any) -> int | str:
    """quant_group_size: `auto`, or a number."""
    return "auto" if str(value).strip().lower() == "auto" else as_int(value)


def as_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(value)
    return float(value)


def as_sizes(v: Any) -> list[int]:
    """A size or a list of sizes, sorted."""
    return sorted(as_int(x) for x in (v if isinstance(v, (list, tuple)) else [v]))


def as_most(v: Any) -> int:
    """The original's prefill_batch_size is a list; the most of it counts here."""
    return max(as_sizes(v) or [0])


def as_ports(v: Any) -> list[int]:
    """agent_ports in the YAML's order (agent i serves agent_ports[i]), never sorted."""
    items = v if isinstance(v, (list, tuple)) else [v]
    if not items:
        raise ValueError(v)
    return [as_int(x) for x in items]


def as_cores(v: Any) -> list[list[int]]:
    if not isinstance(v, list) or not all(isinstance(x, list) for x in v):
        raise ValueError(v)
    return [[as_int(c) for c in x] for x in v]


def as_hosts(v: Any) -> list[str]:
    if not isinstance(v, list):
        raise ValueError(v)
    return [str(h) for h in v]


def as_names(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(n, str) and n for n in v):
        raise ValueError(v)
    return list(v)


class Role(str, enum.Enum):
    """What an agent runs (serving_config.agent_roles): prompts and decodes, or only one of them."""
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value


ROLES = tuple(r.value for r in Role)


def as_roles(v: Any) -> list[str]:
    """serving_config.agent_roles: a list, or `prefill,decode` as the CLI gives it."""
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(r, str) for r in items):
        raise ValueError(v)
    return [r.strip().lower() for r in items]


def as_adapters(v: Any) -> dict[str, str]:
    """serving_config.lora_modules: {name: folder}, or vLLM's `name=path` strings."""
    if isinstance(v, (str, list)):
        pairs = [str(p).partition("=") for p in ([v] if isinstance(v, str) else v)]
        if not all(name and eq and path for name, eq, path in pairs):
            raise ValueError(v)
        v = {name: path for name, _, path in pairs}
    if not isinstance(v, dict) or not all(isinstance(k, str) and k and isinstance(p, str) and p for k, p in v.items()):
        raise ValueError(v)
    return dict(v)


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name a LoRA adapter (None: it can). Names become `model` values, log words
    and Prometheus labels: letters, digits and . _ : @ / - (a path-like `org/name` too), at most 128,
    no `..`."""
    if not ADAPTER_NAME.fullmatch(name) or ".." in name:
        return ("a LoRA adapter's name is 1-128 letters, digits and . _ : @ / - starting with a letter or digit, "
                "without '..'")
    return None


def as_blocks(v: Any) -> int:
    """pa_config.num_blocks: a count, or "auto" (0)."""
    return 0 if str(v).strip().lower() == "auto" else as_int(v)


def model_dtype(value: Any) -> str:
    """The dtype the model runs in for a `model_dtype` value: "int8", "bfloat16", "float16" or "gguf"
    for their spellings, else float32 (other values get a notice)."""
    v = str(value).lower()
    return "gguf" if v == "gguf" else "int8" if v in INT8 else "bfloat16" if v in BFLOAT16 else "float16" if v in FLOAT16 else "float32"


def lower(value: Any) -> str:
    return str(value).lower()


WHAT = {as_int: "an integer", as_float: "a number", as_bool: "true or false", parse_bytes: "a byte count such as 8GiB",
        as_blocks: "an integer or auto", as_adapters: "{name: folder} or name=folder strings", as_names: "a name or a list of names", as_cores: "a list of core lists", as_hosts: "a list of hosts",
        as_roles: f"a list of roles ({', '.join(ROLES)})", str: "a string"}


def port_ok(v: int) -> bool:
    return 1 <= v <= 65535
