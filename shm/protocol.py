"""Command codec: one command byte + msgpack header in frame 0; tensor frames may follow (tcp agents).

Keeps the original llm-serving's first-byte protocol: ``*`` a step containing prefill tokens,
``a`` a pure decode step, ``#`` handshake (attach), ``e`` detach (the agent waits for the next
server), ``r`` reset (forcibly detach whichever server is attached); ``h`` heartbeat and ``l`` (a LoRA adapter
into a slot) are ours.
Replies: ``1`` ok, ``2`` failed, both with a msgpack body; a failure names an error `code`.
The full specification is docs/protocol.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

# 2: the handshake carries KV geometry and model identity; `e` detaches instead of exiting.
# 3: `a` rows are fed by the agent's own last samples (`feed` column); arena slots, a step names its `slot`.
# 4: steps may carry `grammars`.
# 5: prompt logprobs: a `targets` column, ScoreOutputs, `n_scored` in a step's header.
# 6: speculative decoding (`spec_len`, `drafted`/`accepted`, DraftOutputs). 7: LoRA: an `adapter` column, `l`.
# 8: KV hand-over: a step's `import` and `export` entries through the `handover` segment.
VERSION = 9  # 9: or, without `handover`, through frames (one per slot: tcp agents)

HANDSHAKE, FULL_STEP, DECODE_STEP, RESET, DETACH, HEARTBEAT = b"#", b"*", b"a", b"r", b"e", b"h"
LOAD_ADAPTER = b"l"  # ours: a LoRA adapter into a slot, between steps
COMMANDS = frozenset({HANDSHAKE, FULL_STEP, DECODE_STEP, RESET, DETACH, HEARTBEAT, LOAD_ADAPTER})
STEP_COMMANDS = frozenset({FULL_STEP, DECODE_STEP})
OK, FAILED = b"1", b"2"
MAX_HEADER_BYTES = 1 << 20

# Error codes of a failed reply.
E_PROTOCOL = "protocol"  # malformed frame: no command was run
E_BUSY = "busy"  # `#` while another live server is attached (send `r` to take the agent over)
E_MISMATCH = "mismatch"  # `#` with a KV geometry or model other than the agent's
E_NOT_ATTACHED = "not_attached"  # a step from a peer that is not the attached server
E_BAD_STEP = "bad_step"  # a step's sizes or indices are out of range; the agent keeps serving
E_FAILED = "failed"  # the command raised; the agent keeps serving
E_FATAL = "fatal"  # the model step raised: the agent exits after this reply and is restarted

# The KV geometry and model identity a server and its agent must agree on (handshake `geometry`, `model`).
GEOMETRY_KEYS = ("block_size", "num_blocks", "max_model_len")
MODEL_KEYS = ("name", "digest", "adapters")
# An agent's KV cache as a hand-over moves it (agent info `kv_layout`): agents whose layouts differ
# in any of these cannot take each other's blocks, even where the blocks' bytes agree (float16 and
# bfloat16). `head_bytes`: one head's key of one token (an int8 row carries its float32 scale).
KV_LAYOUT_KEYS = ("dtype", "block_size", "layers", "kv_heads", "head_dim", "head_bytes")

# Required header keys and their types, per command.
_STEP_KEYS = {"n_tokens": int, "n_rows": int, "width": int, "slot": int, "free": list, "n_scored": int,
              "n_drafts": int}
_REQUIRED: dict[bytes, dict[str, type]] = {
    HANDSHAKE: {"arena": (str, type(None)), "spec": dict, "server_pid": int, "geometry": dict, "model": dict},
    FULL_STEP: _STEP_KEYS, DECODE_STEP: _STEP_KEYS, RESET: {}, DETACH: {}, HEARTBEAT: {},
    LOAD_ADAPTER: {"slot": int, "name": str, "path": (str, type(None))},
}


class ProtocolError(ValueError):
    """A malformed frame: answered with an error reply, never a crash. `msg_id`: the header's `id`
    when the header itself could be read, so the sender gets its answer at once."""

    def __init__(self, message: str, msg_id: Any = None):
        super().__init__(message)
        self.msg_id = msg_id


@dataclass
class Message:
    cmd: bytes
    header: dict[str, Any]
    frames: list[bytes] = field(default_factory=list)


def encode(cmd: bytes, header: dict[str, Any] | None = None, frames: list[bytes] | None = None) -> list[bytes]:
    if cmd not in COMMANDS:
        raise ProtocolError(f"unknown command {cmd!r}")
    h = {"v": VERSION, **(header or {})}
    return [cmd + msgpack.packb(h, use_bin_type=True), *(frames or [])]


def decode(parts: list[bytes]) -> Message:
    if not parts or not parts[0]:
        raise ProtocolError("empty message")
    first = bytes(parts[0])
    cmd = first[:1]
    if cmd not in COMMANDS:
        raise ProtocolError(f"unknown command {cmd!r}")
    if len(first) > MAX_HEADER_BYTES:
        raise ProtocolError("header too large")
    try:
        header = msgpack.unpackb(first[1:], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"bad msgpack header: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    try:
        _check_header(cmd, header)
    except ProtocolError as exc:
        raise ProtocolError(str(exc), header.get("id")) from None
    return Message(cmd, header, [bytes(p) for p in parts[1:]])


def _check_header(cmd: bytes, header: dict[str, Any]) -> None:
    if header.get("v") != VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, expected {VERSION}")
    for key, typ in _REQUIRED[cmd].items():
        if not isinstance(header.get(key), typ) or isinstance(header.get(key), bool):
            raise ProtocolError(f"{cmd.decode()}: header field {key!r} missing or not {typ}")
    if cmd in STEP_COMMANDS:
        for key in ("n_tokens", "n_rows", "width", "slot"):
            if header[key] < 0:
                raise ProtocolError(f"negative {key}")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in header["free"]):
            raise ProtocolError("free must list integer sequence ids")
        _check_grammars(header.get("grammars", []))
        _check_handover(header)
    if cmd == HANDSHAKE:
        for key, names, typ in (("geometry", GEOMETRY_KEYS, int), ("model", MODEL_KEYS, str)):
            for name in names:
                if not isinstance(header[key].get(name), typ) or isinstance(header[key].get(name), bool):
                    raise ProtocolError(f"#: {key}.{name} missing or not {typ.__name__}")


def _check_grammars(grammars: Any) -> None:
    """A step's `grammars`: [seq_id, grammar text, [output ids so far]] per constrained sequence it
    (re)admits."""
    if not isinstance(grammars, list) or not all(
            isinstance(g, list) and len(g) == 3 and isinstance(g[0], int) and isinstance(g[1], str)
            and isinstance(g[2], list) and all(isinstance(t, int) and not isinstance(t, bool) for t in g[2])
            for g in grammars):
        raise ProtocolError("grammars must list [sequence id, grammar, [output ids]]")


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _check_handover(header: dict[str, Any]) -> None:
    """A step's KV hand-over: `export` [seq id, [blocks], [slots]] copied out of the cache after it
    runs, `import` (the same) into it before; the slots are of the shared-memory segment `handover`,
    or (no `handover`) frames: import slot j is the command's j-th frame after the arena's, export
    slot j the reply's. And `histories` [seq id, [tokens]]: the tokens before a row admitted past
    position 0."""
    for key, width in (("export", 3), ("import", 3), ("histories", 2)):
        entries = header.get(key, [])
        if not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) == width and isinstance(e[0], int) and all(map(_ints, e[1:]))
                for e in entries):
            raise ProtocolError(f"{key} must list [sequence id, " + ("[tokens]]" if width == 2 else "[blocks], [slots]]"))
    if not isinstance(header.get("handover", ""), str):
        raise ProtocolError("`handover` must name a shared-memory segment")


def encode_reply(ok: bool, body: dict[str, Any] | None = None, frames: list[bytes] | None = None) -> list[bytes]:
    return [(OK if ok else FAILED) + msgpack.packb(body or {}, use_bin_type=True), *(frames or [])]


def error_reply(code: str, error: str, msg_id: Any) -> list[bytes]:
    return encode_reply(False, {"code": code, "error": error, "id": msg_id})


def decode_reply(parts: list[bytes]) -> tuple[bool, dict[str, Any], list[bytes]]:
    if not parts or not parts[0] or parts[0][:1] not in (OK, FAILED):
        raise ProtocolError("malformed reply")
    try:
        body = msgpack.unpackb(bytes(parts[0][1:]), raw=False)
    except Exception as exc:
        raise ProtocolError(f"bad reply body: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("reply body is not a map")
    return parts[0][:1] == OK, body, [bytes(p) for p in parts[1:]]
