"""Reference fixtures from Hugging Face transformers: for a tiny seeded random model of each family,
the folder transformers saves (config.json in its own layout, model.safetensors) and, from
transformers' float32 forward, 4 prompts' greedy continuations and the logits at every position.
tests/agent/test_families.py loads each folder through our loader and compares.

Run by hand in a separate venv (CI never installs torch):

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/ref/bin/python -m tools.make_goldens --out tests/fixtures/families

transformers 5.x writes `rope_parameters`; 4.x (`pip install 'transformers<5'`) writes top-level
`rope_theta` / `rope_scaling`: each run names its folders by the layout it wrote (`-tf5`, `-tf4`).

A real GGUF (transformers' own GGUF reader: `pip install gguf accelerate` too): `--gguf FILE --out
X.npz` keeps, for a few text prompts, transformers' token ids, its greedy continuation and each
position's top logits (a 262k vocabulary's full rows would be megabytes).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PROMPTS = [[5, 17, 99, 3, 200, 41, 7], [250, 1, 2], list(range(30, 50)), [9]]
NEW_TOKENS = 32
SHAPE = dict(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=256,
             eos_token_id=257)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
# name: (transformers config class, its arguments beyond SHAPE, rope parameters)
FAMILIES = {
    "llama": ("LlamaConfig", {}, dict(rope_type="default", rope_theta=10000.0)),
    "llama3": ("LlamaConfig", dict(tie_word_embeddings=True), dict(LLAMA3, rope_theta=500000.0)),
    "llama-linear": ("LlamaConfig", {}, dict(rope_type="linear", factor=2.0, rope_theta=10000.0)),
    "mistral": ("MistralConfig", dict(sliding_window=512), dict(rope_type="default", rope_theta=1000000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), dict(rope_type="default", rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=32), dict(rope_type="default", rope_theta=1000000.0)),
    # sliding windows shorter than the prompts + 32 tokens: Mistral's on every layer, Qwen2's from layer 1
    "mistral-window": ("MistralConfig", dict(sliding_window=8), dict(rope_type="default", rope_theta=10000.0)),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                     dict(rope_type="default", rope_theta=10000.0)),
    # a sliding layer (window 8, its own rope base) then a global one (linear scaling); the attention
    # scale from query_pre_attn_scalar, not head_dim
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"]),
               {"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
    # as a gemma3 GGUF can hold it (the attention scale from head_dim), two sliding layers to a global one
    "gemma3-pattern": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                                                num_hidden_layers=3, layer_types=["sliding_attention"] * 2 + [
                                                    "full_attention"]),
                       {"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0),
                        "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
    # Mistral's layer with sliding and full layers by layer_types: a family that is only flags
    "ministral": ("MinistralConfig", dict(head_dim=16, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"]),
                  dict(rope_type="default", rope_theta=1000000.0)),
}


def config(name: str, major: int):
    import transformers

    cls, extra, rope = FAMILIES[name]
    kwargs = dict(SHAPE, **extra)
    if major >= 5:
        kwargs["rope_parameters"] = rope
    else:  # 4.x: theta at the top, scaling (if any) apart; Gemma's sliding layers' base apart
        if "full_attention" in rope:
            kwargs["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
            rope = rope["full_attention"]
        rope = dict(rope)
        kwargs["rope_theta"] = rope.pop("rope_theta")
        if rope["rope_type"] != "default":
            kwargs["rope_scaling"] = rope
    return getattr(transformers, cls)(**kwargs)


def randomise(model, seed: int) -> None:
    """Seeded values with some spread everywhere: transformers' init leaves biases at 0 and norm
    gains at 1, which would hide a dropped bias or gain, and its 0.02 std makes near-flat logits.
    The layers' outputs (o, down) are 3x larger than the embeddings: where the embedding dominates
    the residual, a tied head just repeats the last token, whatever the layers compute."""
    import torch

    g = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type.startswith("gemma")  # norms scale by 1 + w; embeddings by sqrt(hidden)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 2:
                gain = 3.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:  # a norm's gain
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
        if not gemma:
            model.model.embed_tokens.weight.mul_(8.0)  # embeddings ~N(0, 1), as trained ones are, not 1/8


def golden(model) -> dict[str, np.ndarray]:
    """Greedy continuations (float32, one full forward per token) and the logits at every position."""
    import torch

    out = {}
    for i, prompt in enumerate(PROMPTS):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([ids])).logits[0]
                ids.append(int(logits[-1].argmax()))
            logits = model(torch.tensor([ids])).logits[0]
        out[f"ids{i}"] = np.asarray(ids, np.int32)
        out[f"logits{i}"] = logits.numpy().astype(np.float32)
    return out


TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village"]
TOP = 16


def gguf_golden(path: Path, new_tokens: int = 16) -> dict[str, np.ndarray]:
    """transformers on a GGUF file: per text prompt its ids (its tokenizer), the greedy continuation,
    and at every position from the last prompt token the top logits (ids, values) and log-sum-exp."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out = {}
    for i, text in enumerate(TEXT_PROMPTS):
        ids = tok(text)["input_ids"]
        n = len(ids)
        with torch.no_grad():
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = model(torch.tensor([ids])).logits[0, n - 1:]
        top = torch.topk(logits, TOP, -1)
        out.update({f"ids{i}": np.asarray(ids, np.int32), f"prompt_len{i}": np.int32(n),
                    f"top_ids{i}": top.indices.numpy().astype(np.int32), f"top{i}": top.values.numpy(),
                    f"lse{i}": torch.logsumexp(logits, -1).numpy()})
    return out


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/families"))
    ap.add_argument("--only", default="", help="comma-separated family names")
    ap.add_argument("--gguf", type=Path, help="a real model's GGUF file: its golden .npz to --out")
    args = ap.parse_args()
    if args.gguf:
        np.savez_compressed(args.out, **gguf_golden(args.gguf), transformers=transformers.__version__)
        return
    major = int(transformers.__version__.split(".")[0])
    torch.manual_seed(0)
    for seed, name in enumerate(FAMILIES):
        if args.only and name not in args.only.split(","):
            continue
        model = AutoModelForCausalLM.from_config(config(name, major), torch_dtype=torch.float32).eval()
        randomise(model, seed)
        folder = args.out / f"{name}-tf{major}"
        model.save_pretrained(folder, safe_serialization=True)
        for extra in ("generation_config.json",):
            (folder / extra).unlink(missing_ok=True)
        np.savez_compressed(folder / "golden.npz", **golden(model))
        (folder / "source.json").write_text(json.dumps({"transformers": transformers.__version__,
                                                        "torch": torch.__version__, "seed": seed}) + "\n")
        print(f"{folder}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
