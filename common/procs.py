"""Process state from /proc: one definition for the server, the agents and the launchers."""
from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name ([] when gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _state(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0] if fields else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (0 when gone)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return _state(pid) not in (None, "Z", "X")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (0 where it cannot be read: gone, or no /proc)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def stopped(pid: int | None) -> bool:
    """Whether a process is stopped (SIGSTOP): alive, but it will never answer."""
    return pid is not None and _state(pid) in ("T", "t")


class Backoff:
    """The one restart policy for agents, the server's supervisor's and launch_agents': restart at
    once, then after 1, 2, 4 ... s (at most 30), and give up after `limit` restarts in a row. What
    ends a row is the caller's: a successful step (server), STABLE_S alive (launch_agents)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    @property
    def exhausted(self) -> bool:
        return self.count >= self.limit

    def next_delay(self) -> float:
        """Count one more restart and return how long to wait before it (check `exhausted` first)."""
        self.count += 1
        return 0.0 if self.count == 1 else min(30.0, 2.0 ** (self.count - 2))

    def reset(self) -> None:
        self.count = 0
