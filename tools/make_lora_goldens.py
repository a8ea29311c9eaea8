"""LoRA reference fixtures from transformers + PEFT: for the tiny Llama and Qwen2 family fixtures
(tools/make_goldens.py), two seeded random adapters each, saved as PEFT saves them, and from PEFT's
float32 forward the logits at every position and the greedy continuation of each prompt, for the base
and each adapter. tests/agent/test_lora.py serves them through our loader and compares.

Run by hand in the goldens' venv (CI never installs torch or peft):

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 transformers safetensors peft
    /tmp/ref/bin/python -m tools.make_lora_goldens --out tests/fixtures/lora
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tools.make_goldens import PROMPTS

NEW_TOKENS = 16
BASES = ("llama-tf5", "qwen2-tf5")
# name: LoraConfig arguments; ranks, targets and scaling differ (rsLoRA on one)
ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all16": dict(r=16, lora_alpha=8, use_rslora=True,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def randomise(model, seed: int) -> None:
    """PEFT starts B at zero (an adapter that changes nothing): both factors seeded random, sized so
    the adapter moves the logits by about as much as a fine-tune does."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def golden(model) -> dict[str, np.ndarray]:
    import torch

    out = {}
    for i, prompt in enumerate(PROMPTS):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out[f"ids{i}"] = np.asarray(ids, np.int32)
            out[f"logits{i}"] = model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)
    return out


def main() -> None:
    import peft
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/lora"))
    ap.add_argument("--families", type=Path, default=Path("tests/fixtures/families"))
    args = ap.parse_args()
    for b, base in enumerate(BASES):
        folder = args.out / base
        model = AutoModelForCausalLM.from_pretrained(args.families / base, dtype=torch.float32).eval()
        folder.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(folder / "base.npz", **golden(model))
        for a, (name, kwargs) in enumerate(ADAPTERS.items()):
            lora = get_peft_model(AutoModelForCausalLM.from_pretrained(args.families / base, dtype=torch.float32),
                                  LoraConfig(task_type="CAUSAL_LM", **kwargs)).eval()
            randomise(lora, 100 * b + a)
            lora.save_pretrained(folder / name)
            np.savez_compressed(folder / f"{name}.npz", **golden(lora))
        (folder / "source.json").write_text(json.dumps({"transformers": transformers.__version__, "peft": peft.__version__,
                                                        "torch": torch.__version__}) + "\n")
        print(folder)


if __name__ == "__main__":
    main()
