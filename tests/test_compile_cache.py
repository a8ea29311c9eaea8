"""The on-disk compile cache never hands back another shape's graph. MindSpore names cached graphs
by compile order, so: start 1 warms up and then meets shapes in one order, start 2 (same cache) meets
them in another order, start 3 has another warm-up list (another config); all give the same logits."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.helpers import ROOT

SCRIPT = r"""
import json, sys
import numpy as np
from agent.runner import ModelRunner, RunnerConfig, compile_cache_key, setup_mindspore
from tests.conftest import tiny_model_config
from tests.reference import random_weights

cfg = tiny_model_config()
rc = RunnerConfig(num_blocks=80, block_size=4, max_model_len=128, decode_buckets=json.loads(sys.argv[2]),
                  prefill_buckets=[8, 16], max_prefill_rows=1, context_buckets=[32, 64])
setup_mindspore(sys.argv[1], key=compile_cache_key(cfg, rc))
runner = ModelRunner(cfg, random_weights(cfg, seed=0), rc)
runner.warmup(rc.warmup_shapes())
out = {}
for p, q, width in json.loads(sys.argv[3]):
    n = p * q
    tokens = (np.arange(n, dtype=np.int32) * 7 % 250).reshape(p, q)
    positions = np.tile(np.arange(q, dtype=np.int32), (p, 1))
    tables = np.zeros((p, width), np.int32)
    tables[:, : -(-q // 4)] = 1 + np.arange(p * -(-q // 4), dtype=np.int32).reshape(p, -1)
    slots = (tables[np.arange(p)[:, None], positions // 4] * 4 + positions % 4).reshape(-1).astype(np.int32)
    logits, _ = runner._run(tokens, positions, slots, tables, np.arange(p, dtype=np.int32) * q + q - 1)
    out[f"{p},{q},{width}"] = logits.tolist()
print("RESULT" + json.dumps(out))
"""
LATER = [[1, 8, 16], [2, 8, 16], [1, 16, 16], [1, 1, 32]]  # the last is a warm-up shape


def _start(tmp: Path, decode_buckets: list[int], shapes: list[list[int]]) -> dict[str, np.ndarray]:
    script = tmp / "order_script.py"  # MindSpore reads its entry script's source: no `python -c`
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp / "ms"), json.dumps(decode_buckets), json.dumps(shapes)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return {k: np.asarray(v) for k, v in json.loads(line[len("RESULT"):]).items()}


def test_shapes_met_in_another_order_after_restart_stay_correct(tmp_path):
    first = _start(tmp_path, [1], LATER)
    runs = [_start(tmp_path, [1], LATER[::-1]), _start(tmp_path, [1, 2], LATER[1:] + LATER[:1])]
    for again in runs:
        assert again.keys() == first.keys()
        for key in first:
            np.testing.assert_allclose(again[key], first[key], atol=1e-5, err_msg=key)
