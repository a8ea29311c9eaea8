"""Offline Hugging Face transformers baseline for tools/compare_peers.sh: the llm-bench random
workload as one left-padded greedy `generate` batch (no server: HF has none). Run with a Python
that has torch and transformers (the vLLM venv does); writes the llm-bench summary keys it can.

    python -m tools.hf_generate MODEL_DIR --num-prompts 64 --input-len 128 --output-len 128 --save-result F
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from llm_serving.bench.serving import random_dataset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    reqs = random_dataset(args.num_prompts, args.input_len, args.output_len, args.seed)
    batch = tok([r.prompt for r in reqs], return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(**tok(["warm up"], return_tensors="pt"), max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                             do_sample=False, pad_token_id=tok.pad_token_id)
        duration = time.perf_counter() - t0
    n_out = int((out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0])
    n_in = int(batch["attention_mask"].sum())
    s = {"completed": len(reqs), "failed": 0, "duration_s": duration, "total_input_tokens": n_in,
         "total_output_tokens": n_out, "request_throughput": len(reqs) / duration,
         "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration,
         "request_rate": float("inf"), "note": "offline batch generate: no TTFT/TPOT"}
    print(f"HF transformers generate, batch {len(reqs)}: {n_out} tokens in {duration:.1f} s = "
          f"{s['output_throughput']:.1f} output tok/s")
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({"summary": s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
