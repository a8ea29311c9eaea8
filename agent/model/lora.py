"""LoRA adapters in the packed step, as vLLM's punica kernels split them: shrink (x·A) then expand
(·B), per token by its adapter.

Shrink: every slot's A rows are extra output rows of their base projection, so the projection's
one GEMM (fused with its norm, activation or attention as before) gives x·W and x·A of every slot,
and the gains and smoothing the base folds into its input apply to A alike. Expand: each token's
own slot's columns times that slot's B, added to x·W (agent/kernels/decoder_stack.cpp; `LoraExpand`
on the four-op and plain paths). The slot count and the rank are fixed at load, so the graphs'
shapes are too: no graph is built after ready."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
from mindspore import Tensor, nn, ops

from agent.model.fusion import row_scale
from agent.model.params import WEIGHT_BLOCK, param
from agent.model_config import ModelConfig

KIND_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                "down": ("down_proj",)}


@dataclass
class LoraSlots:
    """`adapters` (each with `.mats`: (layer, module) -> (A [r, in], B [out, r], scaling folded
    in); None: an empty slot) in slots 0.. of `slots`, each of rank <= `rank`. `gains`: what the
    base folds into each (layer, kind)'s input, kept for slots written later (`write_slot`)."""
    adapters: list[Any]
    slots: int
    rank: int
    gains: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)
    shard: Callable[[Any], Any] = lambda adapter: adapter  # an adapter as this tensor-parallel rank runs it

    def __post_init__(self) -> None:
        if len(self.adapters) > self.slots:
            raise ValueError(f"{len(self.adapters)} LoRA adapters for {self.slots} slots")
        self.adapters = list(self.adapters) + [None] * (self.slots - len(self.adapters))

    def for_rank(self, shard: Callable[[Any], Any]) -> None:
        """Tensor parallel: every adapter, now and written later, split as its base projections are."""
        self.shard = shard
        self.adapters = [shard(a) for a in self.adapters]

    def mask(self, adapters: np.ndarray | None, n: int) -> np.ndarray:
        """A graph call's `n` tokens' slots, one-hot [n, slots] (`adapters`: each token's, 0 none and k
        slot k - 1; None or padding: none)."""
        mask = np.zeros((n, self.slots), np.float32)
        if adapters is not None:
            on = np.nonzero(adapters > 0)[0]
            mask[on, adapters[on] - 1] = 1.0
        return mask

    def load(self, model: Any, slot: int, adapter: Any) -> None:
        """`adapter` (agent.lora.peft.Adapter; None: empty the slot) into slot `slot` of `model`, between
        steps: rows with `adapter` slot + 1 run with it from the next step on."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"LoRA slot {slot}: this model has {self.slots} (serving_config.max_loras)")
        if adapter is not None and adapter.rank > self.rank:
            raise ValueError(f"LoRA adapter {adapter.name}: rank {adapter.rank} is over max_lora_rank {self.rank}")
        write_slot(model, self, slot, self.shard(adapter))

    def kind_rank(self, kind: str) -> int:
        """Columns one slot has in a projection kind: `rank` per module it fuses."""
        return self.rank * len(KIND_MODULES[kind])

    def extra(self, kind: str, padded: bool = True) -> int:
        """Extra output rows of a projection kind: every slot's A rows, padded to whole blocks (float
        weights; int8's float A rows beside the weight are not)."""
        rows = self.slots * self.kind_rank(kind)
        return -(-rows // WEIGHT_BLOCK) * WEIGHT_BLOCK if padded else rows

    def a_rows(self, layer: int, kind: str, n_in: int) -> np.ndarray:
        """Layer `layer`'s extra rows [extra, in] of `kind`: slot s, module j at s * kind_rank + j * rank."""
        out = np.zeros((self.extra(kind), n_in), np.float32)
        for s, adapter in enumerate(self.adapters):
            for j, module in enumerate(KIND_MODULES[kind]):
                ab = adapter.mats.get((layer, module)) if adapter is not None else None
                if ab is not None:
                    start = s * self.kind_rank(kind) + j * self.rank
                    out[start:start + ab[0].shape[0]] = ab[0]
        return out

    def b_stack(self, cfg: ModelConfig, kind: str, widths: Sequence[int], row_scale: Sequence[float]) -> np.ndarray:
        """[layers, slots, rank, out] of `kind`: in slot s's rows, module j's B^T in its `widths[j]`
        output columns, times `row_scale[j]` (what the base folds into those rows). The modules of a
        kind share the rows (each its own columns): an adapter's B bytes, not a block-diagonal's."""
        offsets = np.cumsum([0, *widths])
        out = np.zeros((cfg.num_layers, self.slots, self.rank, int(offsets[-1])), np.float32)
        for s, adapter in enumerate(self.adapters):
            for (layer, module), (a, b) in (adapter.mats.items() if adapter is not None else ()):
                if module in KIND_MODULES[kind]:
                    j = KIND_MODULES[kind].index(module)
                    out[layer, s, :a.shape[0], offsets[j]:offsets[j + 1]] = b.T * np.float32(row_scale[j])
        return out


def b_stacks(lora: LoraSlots, cfg: ModelConfig, q_scale: float) -> dict[str, np.ndarray]:
    """Every kind's expand rows (the query's scaled as the base's query rows are)."""
    q, kv, i, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    return {"qkv": lora.b_stack(cfg, "qkv", (q, kv, kv), (q_scale, 1.0, 1.0)),
            "o": lora.b_stack(cfg, "o", (h,), (1.0,)),
            "gate_up": lora.b_stack(cfg, "gate_up", (i, i), (1.0, 1.0)),
            "down": lora.b_stack(cfg, "down", (h,), (1.0,))}


class LoraExpand(nn.Cell):
    """The expand on the four-op and plain paths: y [T, N + extra] -> x·W + each token's slot's
    (x·A)·B, module by module; `mask` [T, slots] one-hot (a row of zeros: no adapter)."""

    def __init__(self, stacks: dict[str, np.ndarray], cfg: ModelConfig):
        super().__init__()
        self.b_qkv, self.b_o, self.b_gate_up, self.b_down = (param(f"lora_b_{k}", stacks[k]) for k in KIND_MODULES)
        q, kv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        self.cols = {"qkv": (0, q, q + kv, q + 2 * kv), "o": (0, cfg.hidden_size), "gate_up": (0, i, 2 * i),
                     "down": (0, cfg.hidden_size)}

    def inputs(self) -> tuple:
        """The stack op's LoRA inputs after the mask, in its order."""
        return self.b_qkv, self.b_o, self.b_gate_up, self.b_down

    def kind(self, name: str) -> Tensor:
        if name == "qkv":
            return self.b_qkv
        if name == "o":
            return self.b_o
        return self.b_gate_up if name == "gate_up" else self.b_down

    def expand(self, y: Tensor, name: str, i: int, mask: Tensor) -> Tensor:
        b, cols = self.kind(name), self.cols[name]
        slots, rank, n, modules = b.shape[1], b.shape[2], b.shape[3], len(cols) - 1
        u = ops.reshape(y[:, n:n + slots * modules * rank], (-1, slots, modules, rank)) * ops.reshape(
            mask, (-1, slots, 1, 1))
        parts = [ops.matmul(ops.reshape(u[:, :, m, :], (-1, slots * rank)),
                            ops.reshape(b[i][:, :, cols[m]:cols[m + 1]], (slots * rank, cols[m + 1] - cols[m])))
                 for m in range(modules)]
        delta = parts[0] if modules == 1 else ops.concat(parts, 1)
        return y[:, :n] + delta


def write_slot(model: Any, lora: LoraSlots, slot: int, adapter: Any) -> None:
    """`adapter` (None: empty the slot) into slot `slot` of a built model (agent.model.decoder), in
    place: its A rows into each projection's extra rows (the base's gains folded in, stored as the
    projection stores rows), its B rows into the expand's. Between steps only; no graph changes."""
    one = LoraSlots([adapter], 1, lora.rank)
    stacks = b_stacks(one, model.cfg, row_scale(model.cfg, model.cfg.scale))
    for kind in KIND_MODULES:
        proj, b = getattr(model, kind), model.lora.kind(kind)
        n, rk = b.shape[3], lora.kind_rank(kind)
        for i in range(model.cfg.num_layers):
            gain = lora.gains[(i, kind)]
            rows = one.a_rows(i, kind, gain.shape[0])[:rk] * gain[None, :]
            proj.put_rows(i, n + slot * rk, rows)
        b.asnumpy()[:, slot] = stacks[kind][:, 0]
    lora.adapters[slot] = adapter
