"""Where an agent listens, and who owns a port.

A local agent listens on an ipc socket named after its port in the runtime folder
(`LLM_SERVING_RUNTIME_DIR`, default the temp folder); a remote one on tcp. Every agent holds an
exclusive `flock` on `llm-serving-agent-<port>.lock` (its pid inside) from before it loads the model
until it exits: the kernel drops the lock when the process dies, however it dies, so "port in use
by pid P" and "stale socket file" are both decided by the lock, never by guessing from timeouts.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from common.config import ConfigError

PREFIX = "llm-serving-agent-"


class PortInUse(RuntimeError):
    def __init__(self, port: int, pid: int | None):
        super().__init__(f"port {port} in use by pid {pid}" if pid else f"port {port} in use")
        self.port, self.pid = port, pid


def runtime_dir() -> Path:
    return Path(os.environ.get("LLM_SERVING_RUNTIME_DIR", tempfile.gettempdir()))


def is_local(ip: str | None) -> bool:
    return ip in ("127.0.0.1", "localhost", "", None)


SUN_PATH_MAX = 107  # bytes of a unix socket's path (Linux's sun_path, less its NUL)


def socket_path(port: int) -> Path:
    path = runtime_dir() / f"{PREFIX}{port}.sock"
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise ConfigError(f"the agent socket {path} is {len(os.fsencode(path))} bytes, over the {SUN_PATH_MAX} a "
                          "unix socket takes: set LLM_SERVING_RUNTIME_DIR to a shorter folder")
    return path


def lock_path(port: int) -> Path:
    return runtime_dir() / f"{PREFIX}{port}.lock"


def agent_address(port: int, ip: str | None = "127.0.0.1") -> str:
    """Local agents use an ipc socket named after their port; remote ones tcp on that port."""
    return f"ipc://{socket_path(port)}" if is_local(ip) else f"tcp://{ip}:{port}"


def dial_host(bind: str) -> str:
    """Where a process on the agent's own host reaches an agent listening on `bind` (a wildcard
    bind is reached through loopback)."""
    return {"0.0.0.0": "127.0.0.2", "::": "::1", "*": "127.0.0.2"}.get(bind, bind)


def parse_agents(spec: str) -> list[tuple[str, int]]:
    """`host:port,host:port,...` (IPv6 as [addr]:port) -> [(host, port)]; ValueError naming the bad entry."""
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--agents entry {item!r}: expected host:port")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("--agents: no host:port given")
    return out


def lws_agents(env: dict[str, str], port: int) -> list[tuple[str, int]] | None:
    """The agents of a LeaderWorkerSet group as its leader (the server) finds them: workers 1 ..
    LWS_GROUP_SIZE-1, whose hostnames are the leader's with `-<index>` (`lws-0.lws.ns` ->
    `lws-0-1.lws.ns`), each running launch_agents on `port`. None outside LWS or off the leader."""
    leader, size = env.get("LWS_LEADER_ADDRESS"), env.get("LWS_GROUP_SIZE")
    if not leader or not size or env.get("LWS_WORKER_INDEX", "0") != "0":
        return None
    first, dot, rest = leader.partition(".")
    return [(f"{first}-{i}{dot}{rest}", port) for i in range(1, int(size))]


def _lock(path: Path) -> int | None:
    """An fd holding the exclusive lock of `path` (created if missing), or None if another process
    holds it. Re-checks the inode: a holder that unlinked the file on exit must not leave us a lock
    on a file nobody else can see."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def holder(port: int) -> int | None:
    """The pid of the live agent that owns `port` (0 if its pid is unreadable), or None."""
    path = lock_path(port)
    if not path.exists():
        return None
    fd = _lock(path)
    if fd is not None:  # nobody holds it: stale, left by a killed agent
        _remove(port, fd)
        return None
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _remove(port: int, fd: int) -> None:
    """Unlink the port's socket and lock files while holding the lock, then release it."""
    socket_path(port).unlink(missing_ok=True)
    lock_path(port).unlink(missing_ok=True)
    os.close(fd)


class PortLock:
    """Held by an agent for its whole life; `release` removes its socket and lock files."""

    def __init__(self, port: int):
        self.port = port
        runtime_dir().mkdir(parents=True, exist_ok=True)
        fd = _lock(lock_path(port))
        if fd is None:
            raise PortInUse(port, holder(port))
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        socket_path(port).unlink(missing_ok=True)  # a killed agent's socket: we own the port now
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            _remove(self.port, self.fd)
            self.fd = None


def clean_stale_endpoints() -> list[int]:
    """Remove socket and lock files of agents that are gone (a SIGKILLed agent cannot clean up)."""
    ports = set()
    for path in runtime_dir().glob(f"{PREFIX}*"):
        stem = path.name[len(PREFIX):].split(".")[0]
        if stem.isdigit():
            ports.add(int(stem))
    removed = []
    for port in sorted(ports):
        if not lock_path(port).exists():
            socket_path(port).unlink(missing_ok=True)  # an older agent's socket without a lock
            removed.append(port)
        elif holder(port) is None:
            removed.append(port)
    return removed
