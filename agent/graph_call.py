"""Calls a built graph without MindSpore's per-call compile check.

`Cell.__call__` in graph mode re-derives the graph's key from the arguments on every call
(`generate_arguments_key`, attribute writes on the Cell, phase strings) before it runs the graph:
~1 ms of a ~12 ms one-token int8 SmolLM2 step (Zen 3, median of 200 calls each way, same process).
The graphs here have static shapes, so the key follows from the argument shapes alone: the first
call of a shape goes through the Cell (building or loading its graph) and records the phase it
ran; later calls of that shape hand the tensors to the graph executor under that phase, as
MindSpore's own fast path for mindformers' "increment" phase does (`Cell._predict`).
"""
from __future__ import annotations

from typing import Any


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
