"""Fixed-layout step arena in one POSIX shared-memory segment per agent.

The server writes a step's inputs, the agent writes the sampled outputs back. The layout is fixed by
three capacities (tokens, rows, blocks per row) that travel in the handshake, so both sides compute
identical offsets. Only this module knows the layout.
"""
from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
PREFIX = "llmserving"
MAX_TOP_LOGPROBS = 20

# (name, dtype, dims) where dims uses "T" tokens, "R" rows, "W" blocks per row, "N" top logprobs.
INPUT_FIELDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("tokens", "int32", ("T",)),
    ("positions", "int32", ("T",)),
    ("slots", "int32", ("T",)),
    ("query_lens", "int32", ("R",)),
    ("block_tables", "int32", ("R", "W")),
    ("seq_ids", "int64", ("R",)),
    ("sample", "int32", ("R",)),  # 1: the row's last token is sampled (decode, or a prompt's last chunk)
    ("prompt_len", "int32", ("R",)),
    ("output_len", "int32", ("R",)),
    ("temperature", "float32", ("R",)),
    ("top_k", "int32", ("R",)),
    ("top_p", "float32", ("R",)),
    ("min_p", "float32", ("R",)),
    ("repetition_penalty", "float32", ("R",)),
    ("presence_penalty", "float32", ("R",)),
    ("frequency_penalty", "float32", ("R",)),
    ("seed", "int64", ("R",)),
    ("n_logprobs", "int32", ("R",)),
)
OUTPUT_FIELDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("out_ids", "int32", ("R",)),
    ("out_logprobs", "float32", ("R",)),
    ("out_top_ids", "int32", ("R", "N")),
    ("out_top_logprobs", "float32", ("R", "N")),
)
ALL_FIELDS = INPUT_FIELDS + OUTPUT_FIELDS
_ALIGN = 64


@dataclass(frozen=True)
class ArenaSpec:
    max_tokens: int
    max_rows: int
    max_blocks: int

    def dims(self) -> dict[str, int]:
        return {"T": self.max_tokens, "R": self.max_rows, "W": self.max_blocks, "N": MAX_TOP_LOGPROBS}

    def layout(self) -> tuple[dict[str, tuple[int, np.dtype, tuple[int, ...]]], int]:
        """Field -> (byte offset, dtype, shape); and the total size."""
        dims, offset, out = self.dims(), 0, {}
        for name, dtype, shape in ALL_FIELDS:
            dt = np.dtype(dtype)
            sh = tuple(dims[d] for d in shape)
            out[name] = (offset, dt, sh)
            offset += -(-int(np.prod(sh)) * dt.itemsize // _ALIGN) * _ALIGN
        return out, offset

    def to_wire(self) -> dict[str, int]:
        return {"max_tokens": self.max_tokens, "max_rows": self.max_rows, "max_blocks": self.max_blocks}

    @classmethod
    def from_wire(cls, d: dict) -> "ArenaSpec":
        spec = cls(int(d["max_tokens"]), int(d["max_rows"]), int(d["max_blocks"]))
        if min(spec.max_tokens, spec.max_rows, spec.max_blocks) <= 0 or spec.layout()[1] > 1 << 34:
            raise ValueError(f"bad arena spec {d}")
        return spec


class Arena:
    """Numpy views over a buffer laid out by ``ArenaSpec``; ``fields[name]`` is the full-capacity array."""

    def __init__(self, spec: ArenaSpec, buf: memoryview | bytearray):
        self.spec = spec
        layout, size = spec.layout()
        if len(buf) < size:
            raise ValueError("buffer smaller than the arena layout")
        self.buf = buf
        self.fields: dict[str, np.ndarray] = {
            name: np.ndarray(shape, dtype, buffer=buf, offset=off) for name, (off, dtype, shape) in layout.items()}

    @classmethod
    def private(cls, spec: ArenaSpec) -> "Arena":
        """An arena in process memory, for a remote (tcp) agent that gets tensors as frames."""
        return cls(spec, bytearray(spec.layout()[1]))

    def __getitem__(self, name: str) -> np.ndarray:
        return self.fields[name]

    def views(self, n_tokens: int, n_rows: int, width: int) -> dict[str, np.ndarray]:
        """The live part of every field for a step of this size."""
        lim = {"T": n_tokens, "R": n_rows, "W": width, "N": MAX_TOP_LOGPROBS}
        out = {}
        for name, _, dims in ALL_FIELDS:
            out[name] = self.fields[name][tuple(slice(0, lim[d]) for d in dims)]
        return out

    def input_frames(self, n_tokens: int, n_rows: int, width: int) -> list[bytes]:
        v = self.views(n_tokens, n_rows, width)
        return [np.ascontiguousarray(v[name]).tobytes() for name, _, _ in INPUT_FIELDS]

    def load_frames(self, names: tuple[tuple[str, str, tuple[str, ...]], ...], frames: list[bytes],
                    n_tokens: int, n_rows: int, width: int) -> None:
        if len(frames) != len(names):
            raise ValueError(f"expected {len(names)} tensor frames, got {len(frames)}")
        v = self.views(n_tokens, n_rows, width)
        for (name, dtype, _), raw in zip(names, frames):
            dst = v[name]
            if len(raw) != dst.nbytes:
                raise ValueError(f"frame {name}: {len(raw)} bytes, expected {dst.nbytes}")
            dst[...] = np.frombuffer(raw, dtype=dtype).reshape(dst.shape)

    def output_frames(self, n_rows: int) -> list[bytes]:
        v = self.views(0, n_rows, 0)
        return [np.ascontiguousarray(v[name]).tobytes() for name, _, _ in OUTPUT_FIELDS]


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_segments() -> list[str]:
    """Unlink our segments whose creating process is gone (a killed earlier run)."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}-*"):
        m = _NAME_RE.match(path.name)
        if m and not _pid_alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def our_segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}-*"))
