"""KV hand-over between agents (prefill/decode disaggregation, drains): a sequence's KV blocks copied
out of this agent's cache into hand-over slots, or from hand-over slots into its cache.

A hand-over slot holds one block in one layout whatever the model's own: [k|v, layer, token, kv head,
head row] in the cache's storage dtype (an int8 row carries its scale, common.memory.kv_head_bytes),
so a prefill agent on the stack op and a decode agent on another path still agree. The slots are a
shared-memory segment the server names (local agents) or a step's frames (tcp agents)."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from shm.arena import Segment

if TYPE_CHECKING:
    from agent.runner import ModelRunner

# A test hook: each export takes this much longer (a slow transfer; tests/e2e/test_disaggregation.py).
EXPORT_DELAY_S = float(os.environ.get("LLM_SERVING_HANDOVER_DELAY_S", 0))


class KvPages:
    """Block-granular access to a built model's KV caches (agent.model.decoder.DecoderModel)."""

    def __init__(self, model: Any, block_size: int):
        self.bs = block_size
        self.stacked = model.one_op_stack  # [L, slots, kv, row]; else per layer [slots, kv, row] or plain [kv, slots, row]
        self.head_major = model.attn.head_major
        if self.stacked:
            self.k, self.v = [model.k_cache.asnumpy()], [model.v_cache.asnumpy()]
        else:
            self.k, self.v = ([c.asnumpy() for c in caches] for caches in (model.k_cache, model.v_cache))
        for views, caches in ((self.k, model.k_cache), (self.v, model.v_cache)):
            first = caches if self.stacked else caches[0]
            if not np.shares_memory(views[0], first.asnumpy()):  # a MindSpore that copies here
                raise RuntimeError("the KV cache's asnumpy() is a copy: blocks cannot be handed over")
        self.layers = model.k_cache.shape[0] if self.stacked else len(self.k)
        kv, row = (self.k[0].shape[-2:] if not self.head_major else (self.k[0].shape[0], self.k[0].shape[2]))
        self.slot_shape = (2, self.layers, block_size, kv, row)
        self.dtype = self.k[0].dtype
        self.slot_bytes = int(np.prod(self.slot_shape)) * self.dtype.itemsize

    def slots(self, buf: Any, n: int) -> np.ndarray:
        """`buf` (a segment's memory, or a frame) as hand-over slots [n, 2, L, bs, kv, row]."""
        return np.frombuffer(buf, self.dtype, n * self.slot_bytes // self.dtype.itemsize).reshape(n, *self.slot_shape)

    def _layer_block(self, cache: list[np.ndarray], layer: int, block: int) -> np.ndarray:
        """One layer's block as [token, kv, row] (a view; transposed for the head-major plain cache)."""
        at = slice(block * self.bs, (block + 1) * self.bs)
        if self.stacked:
            return cache[0][layer, at]
        if self.head_major:
            return cache[layer][:, at].transpose(1, 0, 2)
        return cache[layer][at]

    def export(self, blocks: list[int], out: Any, at: list[int]) -> None:
        """Blocks `blocks` of every layer into hand-over slots `at` of `out` (`slots`, or a list of slots)."""
        for j, block in zip(at, blocks, strict=True):
            slot = out[j]
            if self.stacked:
                at = slice(block * self.bs, (block + 1) * self.bs)
                slot[0], slot[1] = self.k[0][:, at], self.v[0][:, at]
                continue
            for layer in range(self.layers):
                slot[0, layer] = self._layer_block(self.k, layer, block)
                slot[1, layer] = self._layer_block(self.v, layer, block)

    def load(self, blocks: list[int], src: Any, at: list[int]) -> None:
        """Hand-over slots `at` of `src` (`slots`, or a list of slots) into blocks `blocks` of every layer."""
        for j, block in zip(at, blocks, strict=True):
            slot = src[j]
            if self.stacked:
                at = slice(block * self.bs, (block + 1) * self.bs)
                self.k[0][:, at], self.v[0][:, at] = slot[0], slot[1]
                continue
            for layer in range(self.layers):
                self._layer_block(self.k, layer, block)[...] = slot[0, layer]
                self._layer_block(self.v, layer, block)[...] = slot[1, layer]


class Handovers:
    """A step's hand-over entries (shm/protocol.py): `import` [seq, blocks, slots] copied into the
    cache before the step runs, `export` [seq, blocks, slots] copied out after it, through the
    server's hand-over segment `handover`, or through the step's frames (a tcp agent)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.pages: KvPages | None = None
        self.segment: Segment | None = None
        self.view: np.ndarray | None = None  # the segment as slots
        self.src: Any = None  # this step's import slots: the segment's, or its frames
        self.dst: Any = None  # this step's export slots: the segment's, or the reply's frames
        self.seconds = 0.0  # the last step's copies took

    def _segment(self, name: str) -> np.ndarray:
        if self.segment is None or self.segment.name != name:
            self.close()
            self.segment = Segment(name)
            self.view = self.pages.slots(self.segment.buf, self.segment.size // self.pages.slot_bytes)
        return self.view

    def _frames(self, frames: list[bytes], h: dict[str, Any]) -> None:
        """Import slots from the command's frames; export slots in new memory, to reply with."""
        sizes = sorted({len(f) for f in frames} - {self.pages.slot_bytes})
        if sizes:
            raise ValueError(f"hand-over frames of {sizes} bytes: a slot is {self.pages.slot_bytes}")
        self.src = [self.pages.slots(f, 1)[0] for f in frames]
        n = sum(len(entry[2]) for entry in h.get("export", []))
        self.dst = np.empty((n, *self.pages.slot_shape), self.pages.dtype)

    def check(self, h: dict[str, Any], frames: list[bytes]) -> None:
        """Every block inside the pool (never block 0) and every slot inside the segment or the
        frames (ValueError); `frames`: the command's after the arena's."""
        self.src = self.dst = None
        if not h.get("import") and not h.get("export"):
            if frames:
                raise ValueError(f"{len(frames)} frames more than the step's tensors, and no hand-over")
            return
        if self.pages is None:
            self.pages = KvPages(self.runner.model, self.runner.rc.block_size)
        if "handover" in h:
            if frames:
                raise ValueError("hand-over frames and a hand-over segment in one step")
            self.src = self.dst = self._segment(h["handover"])
        else:
            self._frames(frames, h)
        for key, view in (("import", self.src), ("export", self.dst)):
            for seq, blocks, at in h.get(key, []):
                if len(blocks) != len(at) or not all(0 < b < self.runner.rc.num_blocks for b in blocks) or not all(
                        0 <= s < len(view) for s in at):
                    raise ValueError(f"{key} of sequence {seq}: blocks {blocks} or slots {at} out of range "
                                     f"({self.runner.rc.num_blocks} blocks, {len(view)} slots)")

    def imports(self, h: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        for seq, blocks, at in h.get("import", []):
            self.pages.load(blocks, self.src, at)
            self.runner.seqs.forget_last(seq)
        self.seconds = time.perf_counter() - t0

    def exports(self, h: dict[str, Any]) -> list[np.ndarray]:
        """Copies the exports out; returns the reply's hand-over frames (none through a segment)."""
        t0 = time.perf_counter()
        for seq, blocks, at in h.get("export", []):
            self.pages.export(blocks, self.dst, at)
        self.seconds += time.perf_counter() - t0
        if EXPORT_DELAY_S and h.get("export"):
            time.sleep(EXPORT_DELAY_S)
        frames = list(self.dst) if self.dst is not None and self.dst is not self.view else []
        self.src = self.dst = None
        return frames

    def close(self) -> None:
        self.view = self.src = self.dst = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None
