"""The on-disk compile cache never hands back another shape's graph. MindSpore names cached graphs
by compile order, so: start 1 warms up and then meets shapes in one order, start 2 (same cache) meets
them in another order, start 3 has another graph set (another config); all give the same logits."""
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
from agent.packing import GraphInputs
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig, compile_cache_key
from agent.graph_call import setup_mindspore
from tests.conftest import tiny_model_config
from tests.reference import random_weights

cfg = tiny_model_config()
rc = RunnerConfig(num_blocks=80, block_size=4, max_model_len=64, token_buckets=json.loads(sys.argv[2]), max_running=2)
setup_mindspore(sys.argv[1], key=compile_cache_key(cfg, rc))
runner = ModelRunner(cfg, random_weights(cfg, seed=0), rc)
runner.warmup()
out = {}
for t, r in json.loads(sys.argv[3]):  # r rows of t // r tokens each, packed
    q = t // r
    tokens = np.arange(t, dtype=np.int32) * 7 % 250
    positions = np.tile(np.arange(q, dtype=np.int32), r)
    token_rows = np.repeat(np.arange(r, dtype=np.int32), q)
    tables = np.zeros((r, rc.width), np.int32)
    tables[:, : -(-q // 4)] = 1 + np.arange(r * -(-q // 4), dtype=np.int32).reshape(r, -1)
    slots = (tables[token_rows, positions // 4] * 4 + positions % 4).astype(np.int32)
    logits, _ = runner._run(GraphInputs(tokens, positions, slots, token_rows, tables,
                                        np.arange(r, dtype=np.int32) * q + q - 1, None))
    out[f"{t},{r}"] = logits.tolist()
print("RESULT" + json.dumps(out))
"""
LATER = [[8, 1], [16, 2], [12, 1], [6, 2], [2, 2]]  # the last is a warm-up shape


def _start(tmp: Path, token_buckets: list[int], shapes: list[list[int]]) -> dict[str, np.ndarray]:
    script = tmp / "order_script.py"  # MindSpore reads its entry script's source: no `python -c`
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp / "ms"), json.dumps(token_buckets), json.dumps(shapes)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return {k: np.asarray(v) for k, v in json.loads(line[len("RESULT"):]).items()}


def test_shapes_met_in_another_order_after_restart_stay_correct(tmp_path):
    first = _start(tmp_path, [1, 2], LATER)
    runs = [_start(tmp_path, [1, 2], LATER[::-1]), _start(tmp_path, [1, 2, 4], LATER[1:] + LATER[:1])]
    for again in runs:
        assert again.keys() == first.keys()
        for key in first:
            np.testing.assert_allclose(again[key], first[key], atol=1e-5, err_msg=key)


def test_an_edit_in_any_room_of_agent_changes_the_cache_folder(tmp_path):
    """The cache folder is keyed by every Python file under agent/, its rooms included: a stale graph
    of edited model code is never replayed."""
    import shutil

    from agent.graph_call import source_digest

    tree = tmp_path / "agent"
    shutil.copytree(ROOT / "agent", tree, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.cpp", "*.h"))
    before = source_digest("key", tree)
    assert source_digest("key", tree) == before and source_digest("other", tree) != before
    decoder = tree / "model" / "decoder.py"
    decoder.write_text(decoder.read_text() + "\n# an edit\n")
    assert source_digest("key", tree) != before
