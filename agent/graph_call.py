"""Calls a built graph without MindSpore's per-call compile check.

`Cell.__call__` in graph mode re-derives the graph's key from the arguments on every call
(`generate_arguments_key`, attribute writes on the Cell, phase strings) before it runs the graph: a
visible share of a small step (docs/perf-notes.md).
The graphs here have static shapes, so the key follows from the argument shapes alone: the first
call of a shape goes through the Cell (building or loading its graph) and records the phase it
ran; later calls of that shape hand the tensors to the graph executor under that phase, as
MindSpore's own fast path for mindformers' "increment" phase does (`Cell._predict`).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from agent import kernels


class GraphCall:
    def __init__(self, cell: Any):
        from mindspore.graph.jit_config import JitConfig
        from mindspore.graph.api import _cell_graph_executor

        self.cell = cell
        self._executor = _cell_graph_executor._graph_executor
        self._jit_config = cell.jit_config_dict or JitConfig().jit_config_dict
        self._phases: dict[tuple, str] = {}  # argument shapes and dtypes -> the phase built for them

    @staticmethod
    def _key(args: tuple) -> tuple:
        return tuple((tuple(a.shape), str(a.dtype)) for a in args)

    def compile(self, *args: Any) -> None:
        """Build (or load) the graph for these arguments without running it."""
        self.cell.compile(*args)
        self._phases[self._key(args)] = self.cell.current_phase

    def __call__(self, *args: Any) -> Any:
        from mindspore.graph.api import _convert_python_data

        phase = self._phases.get(self._key(args))
        if phase is None:
            out = self.cell(*args)
            self._phases[self._key(args)] = self.cell.current_phase
            return out
        self._executor.set_jit_config(self._jit_config)
        return _convert_python_data(self._executor(args, phase))


def device_free_memory(device_id: int) -> int | None:
    """Free memory of this agent's device as MindSpore's runtime reports it (Ascend: free once the
    device is set; GPU: its total), or None on the CPU or where it reports nothing."""
    import mindspore as ms

    target = str(ms.get_context("device_target"))
    if target == "CPU":
        return None
    props = ms.hal.get_device_properties(device_id, target)
    return int(getattr(props, "free_memory", 0) or getattr(props, "total_memory", 0)) or None


def source_digest(key: str = "", folder: Path = Path(__file__).parent) -> str:
    """What a compiled graph depends on besides its shapes: every Python file under agent/ (its rooms
    included), the native kernels' sources and `key`."""
    src = b"".join(p.read_bytes() for p in sorted(folder.rglob("*.py")))
    return hashlib.sha1(src + kernels.sources_digest().encode() + key.encode()).hexdigest()[:16]


def setup_mindspore(cache_dir: str | None = None, key: str = "", device_id: int = 0) -> tuple[str, int]:
    """Graph mode on the chosen device (LLM_SERVING_DEVICE, from serving_config.device) and
    `device_id`, with the on-disk compile cache in a folder keyed by our model source and `key`
    (compile_cache_key): MindSpore's own staleness check missed source changes and replayed a graph
    of the old code. Returns the device target and id MindSpore then reports."""
    import mindspore as ms

    if cache_dir:
        digest = source_digest(key)
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = str(Path(cache_dir) / digest)
    ms.set_context(mode=ms.GRAPH_MODE)
    device = os.environ.get("LLM_SERVING_DEVICE", "CPU")
    ms.set_device(device, device_id)
    if device == "CPU":
        # MindSpore's CPU kernels default to 25 threads whatever the machine: on our few pinned
        # cores they preempt each other. One per core we may run on.
        threads = int(os.environ.get("LLM_SERVING_CPU_THREADS", 0)) or len(os.sched_getaffinity(0))
        try:
            ms.device_context.cpu.op_tuning.threads_num(threads)
        except RuntimeError:  # set once per process; a later runner in the same process keeps it
            pass
    return str(ms.get_context("device_target")), int(ms.get_context("device_id"))


def freeze_compile_cache() -> None:
    """Stop using the on-disk compile cache once warm-up has built its fixed sequence of graphs.
    MindSpore names cached graphs by compile order (compile_cache_0, _1, ...) in one folder read once
    per process, so a graph first built under traffic (shapes met in any order) could be handed to
    another shape on the next start: Reshape size mismatch, and every later step failed. Warm-up
    order is fixed by the key, so its graphs still load from the cache; later ones are built anew."""
    os.environ["MS_COMPILER_CACHE_ENABLE"] = "0"
