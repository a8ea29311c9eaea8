"""Tensor parallelism: one model's ranks, each on its own agent process (and cores), the pattern
vLLM, SGLang and MindFormers share. Q/K/V and gate/up are split by output (heads, FFN columns),
o_proj and down by input, each followed by one all-reduce per layer; the LM head is split by
vocabulary and its logits gathered. The embedding and norms are kept whole (the embedding is ~6% of
a 1.1B model, and whole it needs no collective). KV heads are split across ranks, or replicated
when there are more ranks than KV heads; each rank's KV pool holds only its heads.

Every rank ends a step with the same logits (the all-reduce sums in rank order on every rank), so
every rank samples the same tokens from the same seed: a fed decode needs no broadcast. Rank 0
alone writes the step's outputs and its reply is the step's.
"""
from __future__ import annotations

import ctypes
import itertools
import multiprocessing as mp
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from common.config import ServingConfig
from common.memory import model_shape
from common.model_files import resolve_model
from shm.arena import segment_name

if TYPE_CHECKING:  # the launcher imports this module: no mindspore here
    from agent.model_config import ModelConfig

SEGMENT_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class Group:
    """This agent's place in its model's tensor-parallel group."""
    rank: int = 0
    size: int = 1
    segment: str | None = None  # native collectives (CPU): their shared memory, made by the launcher
    slot_floats: int = 0  # floats one rank may contribute to one collective
    sched_port: int = 0  # else mindspore.communication (mccl on CPU, HCCL, NCCL): the launcher's scheduler

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @classmethod
    def from_link(cls, link: str | None, index: int, size: int, hidden: int, vocab: int, max_tokens: int,
                  max_rows: int) -> "Group":
        """Agent `index`'s rank (index % size) of its replica's group, meeting where the launcher's
        `link` says: "shm:<segment>" (the native collectives) or "ms:<scheduler port>"."""
        if size == 1:
            return cls()
        kind, _, where = (link or "").partition(":")
        if kind == "shm":
            return cls(index % size, size, where, slot_floats(hidden, vocab, max_tokens, max_rows, size))
        if kind == "ms":
            return cls(index % size, size, sched_port=int(where))
        raise ValueError("tensor_parallel_size > 1: start the group with launch_agents or llm-serving "
                         "(they make where its ranks meet)")


def slot_floats(hidden: int, vocab: int, max_tokens: int, max_rows: int, size: int) -> int:
    """The largest collective of a step: a step's activations [tokens, hidden], or one rank's
    logits [rows, vocab / size]."""
    return max(max_tokens * hidden, max_rows * padded_vocab(vocab, size) // size)


def padded_vocab(vocab: int, size: int) -> int:
    return -(-vocab // size) * size


def segment_bytes(size: int, floats: int) -> int:
    """What collective.cpp maps: one cache line per rank, two buffers of a slot per rank."""
    return size * 64 + 2 * size * floats * 4


def create_segment(name: str, size: int, floats: int) -> Path:
    """The group's collective segment, zeroed. A restarted group gets a new one (a new name): a rank
    of the old group may still map the old file."""
    path = SEGMENT_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(size, floats))
    finally:
        os.close(fd)
    return path


def open_group(lib: str, group: Group) -> None:
    """Map the group's segment into the kernel library before any graph runs a collective."""
    rc = ctypes.CDLL(lib).TpOpen(str(SEGMENT_DIR / group.segment).encode(), group.rank, group.size,
                                 ctypes.c_int64(group.slot_floats))
    if rc != 0:
        raise RuntimeError(f"tensor-parallel segment {group.segment}: cannot map it (code {rc})")


def shard(cfg: ModelConfig, weights: Mapping, group: Group, lib: str | None) -> tuple[ModelConfig, Mapping]:
    """The model and weights of this rank, its collectives set up (size 1: as they are): the native
    ones over the group's segment when the kernels are built, else mindspore.communication."""
    if not group.parallel:
        return cfg, weights
    why = check_shape(cfg, group.size)
    if why:
        raise ValueError(why)
    if lib is not None:
        open_group(lib, group)
    else:
        join_mindspore_group(group)
    return rank_config(cfg, group.size), ShardedWeights(weights, cfg, group.rank, group.size)


def join_mindspore_group(group: Group) -> None:
    """mindspore.communication's world of this group (msrun's environment, the launcher's scheduler
    on sched_port): its AllReduce/AllGather then run inside the graphs."""
    if not group.sched_port:
        raise ValueError("tensor parallel without the native kernels runs mindspore.communication: start the group "
                         "with launch_agents or llm-serving, which start its scheduler (LLM_SERVING_NATIVE=0 or "
                         "another device)")
    os.environ.update(MS_ROLE="MS_WORKER", MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(group.sched_port),
                      MS_WORKER_NUM=str(group.size), MS_NODE_ID=str(group.rank))
    from mindspore.communication import init

    init()


def run_scheduler(port: int, size: int) -> None:
    """Spawn target: mindspore.communication's scheduler for one group's `size` ranks (it exits when
    they have all gone)."""
    os.environ.update(MS_ROLE="MS_SCHED", MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port), MS_WORKER_NUM=str(size))
    import mindspore as ms
    from mindspore.communication import init

    ms.set_device(os.environ.get("LLM_SERVING_DEVICE", "CPU"))
    init()


def check_shape(cfg: ModelConfig, size: int) -> str | None:
    """Why `cfg` cannot be split `size` ways, or None."""
    kv_split = cfg.num_kv_heads % size == 0 or size % cfg.num_kv_heads == 0
    if cfg.num_heads % size or cfg.intermediate_size % size or not kv_split:
        return (f"tensor_parallel_size {size} must divide the model's {cfg.num_heads} attention heads and "
                f"{cfg.intermediate_size} FFN columns, and divide or be a multiple of its {cfg.num_kv_heads} KV heads")
    return None


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The model one rank runs: its heads, KV heads and FFN columns; the vocabulary padded to `size`
    shards (the gathered logits are cut back to the vocabulary)."""
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
                   intermediate_size=cfg.intermediate_size // size, tie_word_embeddings=False,
                   head_dim=cfg.head_dim)


# ------------------------------------------------------------------ the launcher's side of a group
_epochs = itertools.count()


def group_link(cfg: ServingConfig, group: list[int]) -> tuple[str | None, Any]:
    """Where a tensor-parallel group's ranks meet, new at every (re)start, and what to stop with
    it: `shm:<segment>` for the native collectives (CPU; named by this launcher's pid, so a dead
    launcher's are cleaned like stale arenas), else `ms:<port>` and mindspore.communication's
    scheduler process. (None, None) for one rank."""
    if len(group) == 1:
        return None, None
    if cfg.device == "CPU" and os.environ.get("LLM_SERVING_NATIVE", "1") != "0":  # agent.kernels.enabled()
        shape = model_shape(resolve_model(cfg.model_path, cfg.model_cfg_path))
        name = segment_name(f"tp{cfg.agent_ports[group[0]]}x{next(_epochs)}")
        create_segment(name, len(group), slot_floats(shape.hidden, shape.vocab, cfg.token_buckets[-1], cfg.max_rows,
                                                     len(group)))
        return f"shm:{name}", name
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sched = mp.get_context("spawn").Process(target=run_scheduler, args=(port, len(group)), daemon=True,
                                            name=f"scheduler{group[0]}")
    sched.start()
    return f"ms:{port}", sched


def stop_link(companion: Any) -> None:
    """What group_link made: its collective segment (unlinked) or scheduler process (stopped)."""
    if isinstance(companion, str):
        (SEGMENT_DIR / companion).unlink(missing_ok=True)
    elif companion is not None:
        companion.kill()
        companion.join(5.0)


@dataclass(frozen=True)
class RankSlices:
    """What rank `rank` of `size` holds of each projection: the query heads' rows (and the o
    projection's inputs), its KV heads' rows, its FFN columns, its vocabulary rows."""
    q: slice
    kv: slice
    ffn: slice
    vocab: slice

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> "RankSlices":
        hd, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q0 = rank * heads // size
        kv0 = q0 // (heads // kv)  # the KV head of the rank's first query head
        f, v = cfg.intermediate_size // size, padded_vocab(cfg.vocab_size, size) // size
        return cls(slice(q0 * hd, (q0 + heads // size) * hd), slice(kv0 * hd, (kv0 + max(1, kv // size)) * hd),
                   slice(rank * f, (rank + 1) * f), slice(rank * v, (rank + 1) * v))

    def module(self, module: str) -> tuple[slice | None, slice | None]:
        """(rows, columns) of a projection's [out, in] matrix this rank holds (None: all)."""
        return {"q_proj": (self.q, None), "k_proj": (self.kv, None), "v_proj": (self.kv, None),
                "o_proj": (None, self.q), "gate_proj": (self.ffn, None), "up_proj": (self.ffn, None),
                "down_proj": (None, self.ffn)}[module]


def shard_adapter(adapter: Any, cfg: ModelConfig, group: Group) -> Any:
    """A LoRA adapter (agent.lora.peft.Adapter) as rank `group.rank` runs it, split as its base
    projections are: B by output rows where the base splits its outputs (Q/K/V, gate/up), A by
    input columns where it splits its inputs (o, down; each rank's (x·A)·B is then a partial sum
    that the layer's all-reduce adds up with the base's)."""
    if adapter is None or not group.parallel:
        return adapter
    slices = RankSlices.of(cfg, group.rank, group.size)
    mats = {}
    for (layer, module), (a, b) in adapter.mats.items():
        rows, cols = slices.module(module)
        mats[(layer, module)] = (np.ascontiguousarray(a[:, cols] if cols else a),
                                 np.ascontiguousarray(b[rows] if rows else b))
    return replace(adapter, mats=mats)


class ShardedWeights(Mapping):
    """Hugging Face-named weights as rank `rank` of `size` sees them: each tensor sliced when it is
    read (a lazily loaded file keeps one full tensor in memory at a time)."""

    def __init__(self, weights: Mapping, cfg: ModelConfig, rank: int, size: int):
        self.w, self.cfg, self.rank, self.size = weights, cfg, rank, size
        self.slices = RankSlices.of(cfg, rank, size)

    def __iter__(self) -> Iterator[str]:
        yield from self.w
        if "lm_head.weight" not in self.w:
            yield "lm_head.weight"

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __getitem__(self, name: str) -> Any:
        if name == "lm_head.weight":
            head = self.w.get("lm_head.weight")
            if head is None or self.cfg.tie_word_embeddings:
                head = self.w["model.embed_tokens.weight"]
            head = np.asarray(head)
            pad = padded_vocab(head.shape[0], self.size) - head.shape[0]
            if pad:  # zero rows: their logits are cut off after the gather
                head = np.concatenate([head, np.zeros((pad, head.shape[1]), head.dtype)])
            return np.ascontiguousarray(head[self.slices.vocab])
        t = self.w[name]
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _MODULES and parts[-1] in ("weight", "bias"):
            rows, cols = self.slices.module(parts[-2])
            if parts[-1] == "bias" and rows is None:  # o/down biases are added once, after the all-reduce
                return t
            t = np.asarray(t)
            return np.ascontiguousarray(t[rows] if rows is not None else t[:, cols])
        return t


_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
