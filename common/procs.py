"""Process state from /proc: one definition for the server, the agents and the launchers."""
from __future__ import annotations

import os
from pathlib import Path


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return _state(pid) not in (None, "Z", "X")


def stopped(pid: int | None) -> bool:
    """Whether a process is stopped (SIGSTOP): alive, but it will never answer."""
    return pid is not None and _state(pid) in ("T", "t")
