"""Command codec: one command byte + msgpack header in frame 0; tensor frames may follow (tcp agents).

Keeps the original llm-serving's first-byte protocol: ``*`` a step containing prefill tokens,
``a`` a pure decode step, ``#`` handshake/attach, ``r`` reset, ``e`` exit; ``h`` heartbeat is ours.
Replies: ``1`` ok, ``2`` failed, both with a msgpack body.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

VERSION = 1

HANDSHAKE, FULL_STEP, DECODE_STEP, RESET, EXIT, HEARTBEAT = b"#", b"*", b"a", b"r", b"e", b"h"
COMMANDS = frozenset({HANDSHAKE, FULL_STEP, DECODE_STEP, RESET, EXIT, HEARTBEAT})
STEP_COMMANDS = frozenset({FULL_STEP, DECODE_STEP})
OK, FAILED = b"1", b"2"
MAX_HEADER_BYTES = 1 << 20

# Required header keys and their types, per command.
_STEP_KEYS = {"n_tokens": int, "n_rows": int, "width": int, "free": list}
_REQUIRED: dict[bytes, dict[str, type]] = {
    HANDSHAKE: {"arena": (str, type(None)), "spec": dict, "server_pid": int},
    FULL_STEP: _STEP_KEYS, DECODE_STEP: _STEP_KEYS, RESET: {}, EXIT: {}, HEARTBEAT: {},
}


class ProtocolError(ValueError):
    """A malformed frame: answered with an error reply, never a crash."""


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
    if header.get("v") != VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, expected {VERSION}")
    for key, typ in _REQUIRED[cmd].items():
        if not isinstance(header.get(key), typ) or isinstance(header.get(key), bool):
            raise ProtocolError(f"{cmd.decode()}: header field {key!r} missing or not {typ}")
    if cmd in STEP_COMMANDS:
        for key in ("n_tokens", "n_rows", "width"):
            if header[key] < 0:
                raise ProtocolError(f"negative {key}")
        if not all(isinstance(s, int) for s in header["free"]):
            raise ProtocolError("free must list integer sequence ids")
    return Message(cmd, header, [bytes(p) for p in parts[1:]])


def encode_reply(ok: bool, body: dict[str, Any] | None = None, frames: list[bytes] | None = None) -> list[bytes]:
    return [(OK if ok else FAILED) + msgpack.packb(body or {}, use_bin_type=True), *(frames or [])]


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
