"""The contest's precision check, both layouts, for tools/test_serving_performance.py.

- Raw logits (the contest's own): a server started with `--dump-logits DIR` writes each sampled
  row's full-vocabulary float32 logits as `<time>_req<id>_pos<position>.npy` (agent/logits_dump.py);
  `dump_raw` sends the prompts one at a time (batch size 1) so the files land in prompt order.
- Top logprobs over HTTP (any server): `dump_top` stores the top-5 logprobs every `every` positions.
`compare` reads two folders of .npy files (the i-th file of one against the i-th of the other, in
name order, i.e. the order written; positions must match) or two JSON dumps, with numpy.allclose
(atol 5e-3) as the contest did, and prints a line per file and a summary line.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import numpy as np

ATOL = 5e-3
POSITION = re.compile(r"pos(\d+)\.npy$")
ROW = re.compile(r"req(\d+)_pos(\d+)\.npy$")


def dump_order(folder: Path) -> list[Path]:
    """A dump's files by request (in the order of their sequence ids) and position. By name alone
    (time first) two requests' files interleave as their steps happened to run, differently in each
    run, and the pairs compared were of different positions on a loaded machine."""
    files = sorted(folder.glob("*.npy"))
    keys = {f: ROW.search(f.name) for f in files}
    if not all(keys.values()):
        return files
    seqs = sorted({int(m[1]) for m in keys.values()})
    return sorted(files, key=lambda f: (seqs.index(int(keys[f][1])), int(keys[f][2]), f.name))


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
    fa, fb = dump_order(a), dump_order(b)
    if not fa or len(fa) != len(fb):
        raise SystemExit(f"{a} has {len(fa)} .npy files, {b} has {len(fb)}: not the same run")
    ok, worst, lines, first = True, 0.0, [], None
    for x, y in zip(fa, fb):
        px, py = POSITION.search(x.name), POSITION.search(y.name)
        if not px or not py or px[1] != py[1]:
            raise SystemExit(f"{x.name} and {y.name} are not of the same position")
        va, vb = np.load(x), np.load(y)
        diff = float(np.abs(va - vb).max()) if va.shape == vb.shape else float("inf")
        close = va.shape == vb.shape and bool(np.allclose(va, vb, atol=ATOL))
        worst = max(worst, diff)
        lines.append(f"{'ok  ' if close else 'FAIL'} {x.name} ~ {y.name}: max |difference| {diff:.2e}")
        if not close and first is None:
            first = f"first difference: {x.name} (position {px[1]})"
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
