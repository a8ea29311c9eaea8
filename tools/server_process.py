"""Start `llm-serving` for a benchmark and wait until it says it is ready: the one helper the tools share."""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY = "llm-serving ready"


def endpoint(config: str) -> tuple[str, str]:
    """The base URL a serving YAML's server answers at, and its model name."""
    import yaml

    cfg = yaml.safe_load(Path(config).read_text())
    sc = cfg.get("serving_config", {})
    return (f"http://{sc.get('server_ip', '127.0.0.1')}:{sc.get('server_port', 8835)}",
            cfg.get("model_config", {}).get("model_name", "smollm2"))


def start_server(args: list[str], log: Path, timeout_s: float = 900, session: bool = True,
                 while_waiting: Callable[[subprocess.Popen], None] | None = None) -> subprocess.Popen:
    """`python -m llm_serving.serve *args`, its output in `log`, once its log says ready (`while_waiting`
    is called between polls). Raises RuntimeError naming the log when it exits or times out first;
    `session`: in its own process session (a group to signal whole)."""
    proc = subprocess.Popen([sys.executable, "-m", "llm_serving.serve", *args], cwd=ROOT, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=session)
    deadline = time.monotonic() + timeout_s
    while READY not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"llm-serving {' '.join(args)} did not start; its log ({log}) ends:\n"
                               f"{log.read_text()[-2000:]}")
        if while_waiting is not None:
            while_waiting(proc)
        time.sleep(0.5)
    return proc
