"""The contest's precision check, both layouts, for tools/test_serving_performance.py.

- Raw logits (the contest's own): a server started with `--dump-logits DIR` writes sampled rows'
  full-vocabulary float32 logits as the contest's agent did, `{time}_{ids}_{position}.npy` at
  absolute positions (agent/logits_dump.py); `dump_raw` sends the prompts one at a time (batch
  size 1), as the contest's procedure did.
- Top logprobs over HTTP (any server): `dump_top` stores the top-5 logprobs every `every` positions.
`compare` reads two folders of .npy files or two JSON dumps, with numpy.allclose (atol 5e-3) as the
contest did, and prints a line per file and a summary line. Files pair by request and position:
`{time}_{ids}_{position}` (the contest's naming, its baseline folder included) or our earlier
`{time}_req{id}_pos{position}`; the k-th file of a request key and position in time order (prompts
whose first ids agree share a key) against the k-th of the other folder.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

import httpx
import numpy as np

ATOL = 5e-3
Pairing = tuple[str, int, int]  # (request key, position, occurrence)


def dump_files(folder: Path) -> dict[Pairing, Path]:
    """A dump's files in the order written (time), each under its pairing key. SystemExit naming a
    file whose name is neither naming."""
    parsed = []
    for f in folder.glob("*.npy"):
        parts = f.stem.split("_")
        try:
            stamp, key, pos = Decimal(parts[0]), parts[1], int(parts[2].removeprefix("pos"))
        except (IndexError, ValueError, ArithmeticError):
            raise SystemExit(f"{f.name}: not a precision file ({{time}}_{{ids}}_{{position}}.npy)") from None
        if len(parts) != 3:
            raise SystemExit(f"{f.name}: not a precision file ({{time}}_{{ids}}_{{position}}.npy)")
        parsed.append((stamp, key, pos, f))
    seen: Counter = Counter()
    out: dict[Pairing, Path] = {}
    for _, key, pos, f in sorted(parsed, key=lambda p: (p[0], p[3].name)):
        out[(key, pos, seen[key, pos])] = f
        seen[key, pos] += 1
    return out


def _greedy(base: str, prompt: str, new: int, logprobs: int = 0) -> dict:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "logprobs": logprobs, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]


def dump_raw(base: str, prompts: list[str], folder: Path, new: int) -> int:
    """Greedy requests one at a time; returns how many .npy files the server wrote into `folder`."""
    before = set(folder.glob("*.npy")) if folder.is_dir() else set()
    for prompt in prompts:
        _greedy(base, prompt, new)
    time.sleep(0.2)  # the agent writes a step's files before it replies; this is only for slow disks
    written = set(folder.glob("*.npy")) - before if folder.is_dir() else set()
    if not written:
        raise SystemExit(f"no logits files appeared in {folder}: start the server with --dump-logits {folder}")
    return len(written)


def dump_top(base: str, prompts: list[str], path: Path, every: int, new: int) -> None:
    dump = []
    for prompt in prompts:
        lp = _greedy(base, prompt, new, logprobs=5)["logprobs"]
        at = range(0, len(lp["top_logprobs"]), every)
        dump.append({"prompt": prompt, "positions": list(at), "top": [sorted(lp["top_logprobs"][p].items()) for p in at]})
    path.write_text(json.dumps(dump, ensure_ascii=False))


def compare(a: Path, b: Path) -> bool:
    ok, worst, lines = (_compare_raw if a.is_dir() and b.is_dir() else _compare_top)(a, b)
    for line in lines:
        print(line)
    print(f"precision {'PASS' if ok else 'FAIL'}: max |difference| {worst:.2e} (atol {ATOL})")
    return ok


def _compare_raw(a: Path, b: Path) -> tuple[bool, float, list[str]]:
    fa, fb = dump_files(a), dump_files(b)
    if not fa or set(fa) != set(fb):
        only = sorted(set(fa) ^ set(fb))[:3]
        raise SystemExit(f"{a} has {len(fa)} .npy files, {b} has {len(fb)}; unpaired (request, position): {only}")
    ok, worst, lines, first = True, 0.0, [], None
    for pairing, x in fa.items():
        y = fb[pairing]
        va, vb = np.load(x), np.load(y)
        diff = float(np.abs(va - vb).max()) if va.shape == vb.shape else float("inf")
        close = va.shape == vb.shape and bool(np.allclose(va, vb, atol=ATOL))
        worst = max(worst, diff)
        lines.append(f"{'ok  ' if close else 'FAIL'} {x.name} ~ {y.name}: max |difference| {diff:.2e}")
        if not close and first is None:
            first = f"first difference: {x.name} (position {pairing[1]})"
        ok &= close
    return ok, worst, lines + ([first] if first else [])


def _compare_top(a: Path, b: Path) -> tuple[bool, float, list[str]]:
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    if [d["prompt"] for d in da] != [d["prompt"] for d in db]:
        raise SystemExit("the two dumps are of different prompts")
    ok, worst, lines = True, 0.0, []
    for i, (x, y) in enumerate(zip(da, db)):
        for pos, ta, tb in zip(x["positions"], x["top"], y["top"]):
            same = [t for t, _ in ta] == [t for t, _ in tb]
            va, vb = np.array([v for _, v in ta]), np.array([v for _, v in tb])
            diff = float(np.abs(va - vb).max()) if same else float("inf")
            close = same and bool(np.allclose(va, vb, atol=ATOL))
            worst = max(worst, diff)
            if not close:
                lines.append(f"FAIL prompt {i} position {pos}: max |difference| {diff:.2e}")
            ok &= close
    return ok, worst, lines
