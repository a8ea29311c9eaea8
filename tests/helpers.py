"""Helpers to run real agent and server processes in tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
GRAPH_CACHE_ENV = "LLM_SERVING_TEST_GRAPH_CACHE"  # the run's shared compile cache (tests/conftest.py)


def graph_cache(tmp: Path) -> str:
    """The compile_cache_dir of a test's config: the run's shared one, else the test's own."""
    return os.environ.get(GRAPH_CACHE_ENV) or str(tmp / "mscache")


def channel_refused_here() -> bool:
    """Per channel, oneDNN's int8 matmul needs VNNI or AMX (below them its int16 pair sums saturate):
    where the CPU (as LLM_SERVING_MAX_ISA caps it) has neither, the product refuses the path in one
    line, and the tests of the path assert that line instead."""
    import numpy as np
    import pytest

    from agent.kernels import pack_int8_channel
    from common.cpu import cpu_flags

    if cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        return False
    with pytest.raises(RuntimeError, match=r"quant_group_size -1 cannot run on this CPU: .*no VNNI or AMX"):
        pack_int8_channel(np.ones((64, 64), np.int8))
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(tmp: Path, model_dir: Path, n_agents: int = 1, **serving: Any) -> Path:
    """A serving YAML for the tiny test model; `serving`, `pa_config` and bucket keys override defaults
    (fewer buckets: fewer graphs to build before ready)."""
    pa = {"num_blocks": serving.pop("num_blocks", 128), "block_size": serving.pop("block_size", 4),
          "decode_seq_length": serving.pop("decode_seq_length", 128)}
    buckets = {"seq_length": serving.pop("seq_length", [16, 32]),
               "decode_batch_size": serving.pop("decode_batch_size", [1, 4, 8])}
    doc = {
        "model_config": {"model_name": "tiny", "model_path": str(model_dir),
                         "max_generate_length": serving.pop("max_generate_length", 128),
                         **buckets, "prefill_batch_size": [2], "zactivate_len": [64]},
        "serving_config": {"agent_ports": [free_port() for _ in range(n_agents)], "server_ip": "127.0.0.1",
                           "server_port": free_port(), "compile_cache_dir": graph_cache(tmp), **serving},
        "pa_config": pa,
    }
    path = tmp / f"tiny-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


class ServerProcess:
    """`llm-serving --config X` as a real child process (it spawns its agents); `script`: another
    entry point taking the same arguments (examples/start.py)."""

    def __init__(self, config: Path, *extra: str, timeout_s: float = 300, env: dict[str, str] | None = None,
                 script: str | None = None):
        self.config_path, self.config = config, yaml.safe_load(config.read_text())
        self.url = f"http://127.0.0.1:{self.config['serving_config']['server_port']}"
        self.log = config.with_suffix(".log")
        entry = [script] if script else ["-m", "llm_serving.serve"]
        self.proc = subprocess.Popen([sys.executable, *entry, "--config", str(config), *extra],
                                     cwd=ROOT, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while "llm-serving ready" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def agent_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split()]
        # multiprocessing's resource tracker is a child too; agents are the spawn_main children (one
        # that exits between pgrep and the read, a killed agent, is not one)
        return [p for p in pids if "spawn_main" in _cmdline(p)]

    @contextmanager
    def agents_paused(self) -> Iterator[None]:
        """Every agent stopped (SIGSTOP) inside the block: the server admits and schedules, no step
        ends, so a test reads a state (requests running, several at once) without racing the model.
        Kept well inside step_timeout_s (120 s), after which a stuck agent is restarted."""
        pids = self.agent_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    def stats_until(self, done: Callable[[dict], bool], timeout_s: float = 60) -> dict:
        """/stats once `done(stats)` holds: waiting on the server's own state, `timeout_s` only
        bounding a failure."""
        deadline = time.monotonic() + timeout_s
        while not done(info := httpx.get(f"{self.url}/stats", timeout=10).json()):
            if time.monotonic() > deadline:
                raise AssertionError(f"/stats never got there: {info}")
            time.sleep(0.05)
        return info

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


_HF_TO_MF = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
             "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
             "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2"}


def save_mindformers(tmp: Path, weights: dict, extra: dict | None = None) -> tuple[Path, Path]:
    """The tiny model as a MindFormers checkpoint (MindFormers parameter names; `extra`: more
    parameters as named) and model yaml whose load_checkpoint names it, as the original's
    model_cfg_path expects."""
    import mindspore as ms

    from tests.conftest import TINY

    params = []
    for name, arr in weights.items():
        if name == "model.embed_tokens.weight":
            mf = "model.tok_embeddings.embedding_weight"
        elif name == "model.norm.weight":
            mf = "model.norm_out.weight"
        elif name == "lm_head.weight":
            mf = name
        else:
            parts = name.split(".")
            mf = f"model.layers.{parts[2]}.{_HF_TO_MF['.'.join(parts[3:-1])]}.weight"
        params.append({"name": mf, "data": ms.Tensor(arr)})
    params += [{"name": name, "data": ms.Tensor(arr)} for name, arr in (extra or {}).items()]
    ckpt = tmp / "llama.ckpt"
    ms.save_checkpoint(params, str(ckpt))
    cfg_yaml = tmp / "predict_llama_tiny.yaml"
    cfg_yaml.write_text(yaml.safe_dump({"load_checkpoint": str(ckpt), "model": {"model_config": {
        "hidden_size": TINY["hidden_size"], "num_layers": TINY["num_hidden_layers"],
        "num_heads": TINY["num_attention_heads"], "n_kv_heads": TINY["num_key_value_heads"],
        "vocab_size": TINY["vocab_size"], "rms_norm_eps": 1e-5, "seq_length": 512,
        "bos_token_id": 256, "eos_token_id": 257}}}))
    return ckpt, cfg_yaml


def results(tokens: list[int | None]) -> list:
    """Scheduler.update's per-row results for rows that each sampled one token (None: nothing kept)."""
    from server.sched.step_plan import RowResult
    return [RowResult([] if t is None else [t]) for t in tokens]


class Launcher:
    """`launch_agents --config X` as a real child process, with its own runtime folder."""

    def __init__(self, config: Path, env: dict[str, str]):
        self.log = config.with_suffix(".launch.log")
        self.proc = subprocess.Popen([sys.executable, "-m", "llm_serving.launch", "--config", str(config)], cwd=ROOT,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while "all agents started" not in self.log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)

    def agent_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split() if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]


def run_python(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
