"""Activation ranges for int8 smoothing (SmoothQuant, Xiao et al. 2023), from the NumPy decoder in
float32 (agent/model/numpy_decoder.py) over a short calibration text.

A few input channels of every projection carry most of the activation magnitude; quantised per
token as they come, they leave the other channels a handful of int8 steps. Smoothing divides each
channel by s = max|x|^0.5 / max|w|^0.5 (agent.model.quant.smoothing) and multiplies the weight
column by s (the kernel applies 1/s with the norm gain, so it costs nothing per step). Text calibrates
far better than random token ids (docs/perf-notes.md). The calibration text is not the evaluation
corpus.
"""
from __future__ import annotations

import numpy as np

from agent.model.numpy_decoder import NumpyDecoder
from agent.model_config import ModelConfig, Weights

CALIBRATION_TEXT = """\
User: Can you explain how a refrigerator keeps food cold?
Assistant: A refrigerator moves heat from the inside to the outside. A liquid called a refrigerant
evaporates in pipes inside the cabinet, absorbing heat, and a compressor then squeezes the vapour
so that it releases that heat through the coils at the back.
def merge_sorted(a, b):
    result, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i]); i += 1
        else:
            result.append(b[j]); j += 1
    return result + a[i:] + b[j:]
The committee met on Tuesday, 14 March, to discuss the budget for the coming year. Three members
argued that the museum should open on Sundays; the treasurer warned that heating costs had risen by
twelve per cent. In the end they agreed to a trial of six months.
Q: What is the boiling point of water in Fahrenheit? A: 212 degrees.
Les montagnes étaient couvertes de neige, et le village dormait encore quand le train arriva.
Mountains, rivers and forests cover most of the island, which has fewer than ten thousand people.
"""


def activation_ranges(cfg: ModelConfig, w: Weights, ids: list[int]) -> dict[str, list[np.ndarray]]:
    """Per projection ("qkv", "o", "gate_up", "down", per layer; "head", once): the largest |value|
    of each input channel over the calibration tokens, norm gains applied (as the kernel sees them)."""
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("qkv", "o", "gate_up", "down", "head")}
    tap = lambda kind, a: out[kind].append(np.abs(a).max(0))  # noqa: E731
    # a byte-level vocabulary spends ~1000 tokens on the text
    NumpyDecoder(cfg, w, np.float32, tap).forward(ids[:cfg.max_position], logits=False)
    return out
