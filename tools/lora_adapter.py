"""A seeded random LoRA adapter for any Llama-shaped model, written as PEFT writes one
(adapter_config.json, adapter_model.safetensors): for tests and benchmarks, numpy only; and a PEFT
folder written as llama.cpp's convert_lora_to_gguf.py writes it (a LoRA adapter GGUF).

    python -m tools.lora_adapter --model smollm2 --rank 16 --out /tmp/ft1
    python -m tools.lora_adapter --model smollm2 --to-gguf /tmp/ft1 --out /tmp/ft1.gguf
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection, from a Hugging Face config.json."""
    h, heads, i = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    hd = config.get("head_dim") or h // heads
    q, kv = heads * hd, config.get("num_key_value_heads", heads) * hd
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def random_adapter(out: Path, config: dict, rank: int = 16, alpha: float = 32.0,
                   modules: tuple[str, ...] = ALL_MODULES, seed: int = 0, scale: float = 0.5) -> Path:
    """`out` holding the adapter; A and B both random (PEFT's B starts at zero: a no-op adapter)."""
    from safetensors.numpy import save_file

    rng, dims = np.random.default_rng(seed), shapes(config)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for m in modules:
            n_out, n_in = dims[m]
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if m.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = (scale * rng.standard_normal((rank, n_in)) / n_in ** 0.5).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (scale * rng.standard_normal((n_out, rank)) / rank ** 0.5).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none",
        "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False}))
    return out


def write_gguf_adapter(folder: Path, model: str, out: Path, alpha: float | None = None) -> Path:
    """The PEFT adapter in `folder` (for base `model`) as llama.cpp converts one: the base's GGUF
    architecture and tensor names (the gguf package's map) + `.lora_a` / `.lora_b`, f32, Llama's Q/K
    lora_b rows permuted as its base rows are, `adapter.lora.alpha` from the config (or `alpha`:
    llama.cpp scales by alpha / r, so an rsLoRA adapter needs alpha x sqrt(r) to keep its scale)."""
    import gguf
    from safetensors.numpy import load_file

    from agent.weights.load import load_model
    from common.model_files import resolve_model
    from tools.export_model import GGUF_ARCH, permute_qk

    cfg = load_model(resolve_model(model))[0]
    arch = GGUF_ARCH[cfg.family.name]
    config = json.loads((folder / "adapter_config.json").read_text())
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_layers)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"] if alpha is None else alpha))
    for key, t in sorted(load_file(folder / "adapter_model.safetensors").items()):
        base, ab = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        name = names.get_name(base + ".weight", try_suffixes=(".weight",))
        if ab == "B.weight" and arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            t = permute_qk(t, cfg.num_heads if name.split(".")[-2] == "attn_q" else cfg.num_kv_heads)
        writer.add_tensor(f"{name}.lora_{ab[0].lower()}", np.ascontiguousarray(t, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def model_config(model: str) -> dict:
    """The config.json keys `shapes` reads, of any model the server loads (a GGUF or MindFormers
    checkpoint included)."""
    from common.memory import model_shape
    from common.model_files import resolve_model

    s = model_shape(resolve_model(model))
    return {"hidden_size": s.hidden, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "intermediate_size": s.inter, "num_hidden_layers": s.layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a model folder or packaged name (its config.json)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--to-gguf", type=Path, help="a PEFT folder to write as a llama.cpp LoRA GGUF at --out")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.to_gguf:
        print(write_gguf_adapter(args.to_gguf, args.model, args.out))
    else:
        print(random_adapter(args.out, model_config(args.model), args.rank, seed=args.seed))


if __name__ == "__main__":
    main()
