"""Fixed-layout step arena in one POSIX shared-memory segment per agent.

The server writes a step's inputs, the agent writes the sampled outputs back. The layout is fixed by
three capacities (tokens, rows, blocks per row) that travel in the handshake, so both sides compute
identical offsets from the field declarations of shm/step.py. The segment holds `slots` such
step areas one after another: the server writes step N+1 into one while the agent runs step N
from the other.
"""
from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.procs import pid_alive
from shm.step import (INPUT_SECTIONS, MAX_TOP_LOGPROBS, OUTPUT_SECTIONS, SECTIONS, RowInput, StepDims, StepView,
                      all_fields, field_specs, step_dims, write_rows)

SHM_DIR = Path("/dev/shm")
PREFIX = "llmserving"
_ALIGN = 64


@dataclass(frozen=True)
class ArenaSpec:
    max_tokens: int
    max_rows: int
    max_blocks: int
    slots: int = 1  # step areas: 2 lets one step be written while the other runs
    MAX_SLOTS = 4

    def dims(self) -> dict[str, int]:
        return {"T": self.max_tokens, "R": self.max_rows, "W": self.max_blocks, "N": MAX_TOP_LOGPROBS,
                "S": self.max_tokens, "D": self.max_tokens}

    def layout(self) -> tuple[dict[str, tuple[int, np.dtype, tuple[int, ...]]], int]:
        """Field -> (byte offset, dtype, shape) in declaration order (shm/step.py); and the total size.
        Every field starts on a 64-byte boundary."""
        dims, offset, out = self.dims(), 0, {}
        for _, f in all_fields():
            shape = tuple(dims[d] for d in f.dims)
            out[f.name] = (offset, f.dtype, shape)
            offset += -(-int(np.prod(shape)) * f.dtype.itemsize // _ALIGN) * _ALIGN
        return out, offset

    @property
    def size(self) -> int:
        """Bytes of the whole segment: every slot."""
        return self.layout()[1] * self.slots

    def to_wire(self) -> dict[str, int]:
        return {"max_tokens": self.max_tokens, "max_rows": self.max_rows, "max_blocks": self.max_blocks,
                "slots": self.slots}

    @classmethod
    def from_wire(cls, d: dict) -> "ArenaSpec":
        try:
            spec = cls(int(d["max_tokens"]), int(d["max_rows"]), int(d["max_blocks"]), int(d["slots"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"bad arena spec {d!r}") from None
        if (min(spec.max_tokens, spec.max_rows, spec.max_blocks, spec.slots) <= 0 or spec.slots > cls.MAX_SLOTS
                or spec.size > 1 << 34):
            raise ValueError(f"bad arena spec {d}")
        return spec

    def fits(self, dims: StepDims) -> bool:
        return (dims.n_tokens <= self.max_tokens and dims.n_rows <= self.max_rows and dims.width <= self.max_blocks
                and 0 <= dims.n_scored <= dims.n_tokens and 0 <= dims.n_drafts <= dims.n_tokens)


class Arena:
    """Typed numpy views over one slot of a buffer laid out by `ArenaSpec`: `full` spans the
    capacity, `step()` the live part of one step."""

    def __init__(self, spec: ArenaSpec, buf: memoryview | bytearray, slot: int = 0):
        self.spec, self.slot = spec, slot
        layout, size = spec.layout()
        if not 0 <= slot < spec.slots or len(buf) < size * spec.slots:
            raise ValueError("buffer smaller than the arena layout")
        self.buf = buf
        base = slot * size
        arrays = {name: np.ndarray(shape, dtype, buffer=buf, offset=base + off)
                  for name, (off, dtype, shape) in layout.items()}
        self.full = StepView(*(cls(**{f.name: arrays[f.name] for f in field_specs(cls)}) for cls in SECTIONS))
        self._last: tuple[StepDims, StepView] | None = None

    @classmethod
    def slots(cls, spec: ArenaSpec, buf: memoryview | bytearray | None = None) -> list["Arena"]:
        """Every slot of a segment's buffer (or of a private one in process memory, for a remote
        tcp agent that gets tensors as frames)."""
        buf = bytearray(spec.size) if buf is None else buf
        return [cls(spec, buf, k) for k in range(spec.slots)]

    @classmethod
    def private(cls, spec: ArenaSpec) -> "Arena":
        """A one-step arena in process memory (tools and tests that drive a runner directly)."""
        return cls.slots(ArenaSpec(spec.max_tokens, spec.max_rows, spec.max_blocks))[0]

    def step(self, dims: StepDims) -> StepView:
        """The live part of every field for a step of this size. The last one is kept: decode steps
        repeat their sizes, and building the 24 views is a visible part of a small step (docs/perf-notes.md)."""
        if self._last is not None and self._last[0] == dims:
            return self._last[1]
        lim = {"T": dims.n_tokens, "R": dims.n_rows, "W": dims.width, "N": MAX_TOP_LOGPROBS, "S": dims.n_scored,
               "D": dims.n_drafts}
        view = StepView(*(cls(**{f.name: getattr(self.full.section(cls), f.name)[tuple(slice(0, lim[d]) for d in f.dims)]
                                 for f in field_specs(cls)}) for cls in SECTIONS))
        self._last = (dims, view)
        return view

    def write_step(self, rows: list[RowInput], block_size: int) -> StepDims:
        """Encode a step's rows (server side); returns its dims for the command header."""
        dims = step_dims(rows)
        if not self.spec.fits(dims):
            raise ValueError(f"step {dims} exceeds the arena capacity {self.spec}")
        write_rows(self.full, rows, block_size)
        return dims

    def _frames(self, dims: StepDims, sections: tuple[type, ...]) -> list[bytes]:
        v = self.step(dims)
        return [np.ascontiguousarray(getattr(v.section(cls), f.name)).tobytes() for cls, f in all_fields(sections)]

    def _load(self, dims: StepDims, sections: tuple[type, ...], frames: list[bytes]) -> None:
        specs = list(all_fields(sections))
        if len(frames) != len(specs):
            raise ValueError(f"expected {len(specs)} tensor frames, got {len(frames)}")
        v = self.step(dims)
        for (cls, f), raw in zip(specs, frames):
            dst = getattr(v.section(cls), f.name)
            if len(raw) != dst.nbytes:
                raise ValueError(f"frame {f.name}: {len(raw)} bytes, expected {dst.nbytes}")
            dst[...] = np.frombuffer(raw, dtype=f.dtype).reshape(dst.shape)

    @property
    def n_input_frames(self) -> int:
        return len(list(all_fields(INPUT_SECTIONS)))

    @property
    def n_output_frames(self) -> int:
        return len(list(all_fields(OUTPUT_SECTIONS)))

    def input_frames(self, dims: StepDims) -> list[bytes]:
        return self._frames(dims, INPUT_SECTIONS)

    def load_inputs(self, dims: StepDims, frames: list[bytes]) -> None:
        self._load(dims, INPUT_SECTIONS, frames)

    def output_frames(self, dims: StepDims) -> list[bytes]:
        return self._frames(StepDims(0, dims.n_rows, 0, dims.n_scored, dims.n_drafts), OUTPUT_SECTIONS)

    def load_outputs(self, dims: StepDims, frames: list[bytes]) -> None:
        self._load(StepDims(0, dims.n_rows, 0, dims.n_scored, dims.n_drafts), OUTPUT_SECTIONS, frames)


# ---------------------------------------------------------------- POSIX segments
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-[A-Za-z0-9_]+$")


class Segment:
    """A named POSIX shared-memory segment (a /dev/shm file), mode 0600, mapped once.

    Not multiprocessing.shared_memory: its resource tracker unlinks segments an attaching process
    merely opened, and it cannot set permissions."""

    def __init__(self, name: str, size: int = 0, create: bool = False):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"bad segment name {name!r}")
        self.name, self.path, self.owner = name, SHM_DIR / name, create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            self.mmap = mmap.mmap(fd, self.size)
        except BaseException:
            if create:
                self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.buf = memoryview(self.mmap)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Safe to call twice. Callers drop their numpy views first."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None
            try:
                self.mmap.close()
            except BufferError:  # a numpy view still refers to it; unmapped when collected
                pass
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False


def segment_name(tag: str) -> str:
    return f"{PREFIX}-{os.getpid()}-{tag}"


def clean_stale_segments() -> list[str]:
    """Unlink our segments whose creating process is gone (a killed earlier run)."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}-*"):
        m = _NAME_RE.match(path.name)
        if m and not pid_alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def our_segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}-*"))
