"""deploy/ run, not just validated: each container's command starts with exactly the files and
environment its manifest gives it (ConfigMap keys, Secret items, emptyDirs, env values and
secretKeyRefs), laid out under a temporary root, and one request goes end to end through the
layout: `base` (launch_agents and llm-serving --attach in one pod), `remote-agents` (an agents pod
and a server pod over tcp + CURVE, keys made and split into Secrets as the kustomization says) and
`pd-pods` (a prefill pod and a decode pod, KV handed over tcp; `pd`, both in one pod, shares its
launch with `base` and its hand-over with tests/e2e/test_disaggregation.py).

What a test machine must change is changed in the ConfigMap and nowhere else: the tiny model and
small buckets instead of SmolLM2's, free ports, and each pod's address (127.0.0.2, .3, ...: where
`--bind 0.0.0.0` listens and its Service's name resolves)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.manifests import DEPLOY, render
from tests.helpers import ROOT, free_port

READY_S = 300  # a bound for a failing start, not a wait: the test goes on when the server says ready
SHARED = ("/dev/shm",)  # the host's own: the pod's memory-backed emptyDir


def _configmap(doc: dict, model_dir: Path, root: Path, agent_port: int, http_port: int) -> dict[str, str]:
    serving = yaml.safe_load(doc["data"]["serving.yaml"])
    serving["model_config"].update(model_path=str(model_dir), model_name="tiny", seq_length=[16, 32],
                                   decode_batch_size=[1, 4], prefill_batch_size=[2], end_token=[257])
    serving["serving_config"].update(agent_ports=[agent_port], server_port=http_port,
                                     compile_cache_dir=str(root / "cache" / "mindspore"))
    serving["pa_config"].update(num_blocks=64, block_size=4, decode_seq_length=128)
    return {"serving.yaml": yaml.safe_dump(serving)}


def _secrets(tmp: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets the layouts name, made as deploy/common and the kustomization comments say."""
    from tools.curve_keys import make

    keys = tmp / "keys"
    make(keys)
    read = lambda rel: (keys / rel).read_bytes()  # noqa: E731
    return {"llm-serving-keys": {"api-key": b"change-me"},
            "llm-serving-curve-agent": {"agent.key_secret": read("agent.key_secret"),
                                        "authorized-server.key": read("authorized/server.key")},
            "llm-serving-curve-server": {"server.key_secret": read("server.key_secret"), "agent.key": read("agent.key")}}


class Pod:
    """A Deployment's pod template, its volumes laid out under `root` (one folder per pod)."""

    def __init__(self, dep: dict, root: Path, configmaps: dict[str, dict[str, str]],
                 secrets: dict[str, dict[str, bytes]]):
        self.spec, self.root = dep["spec"]["template"]["spec"], root
        self.configmaps, self.secrets = configmaps, secrets
        self.volumes = {v["name"]: v for v in self.spec["volumes"]}

    def path(self, mount: str) -> str:
        return mount if mount.startswith(SHARED) else str(self.root / mount.lstrip("/"))

    def mount(self, m: dict) -> None:
        v, where = self.volumes[m["name"]], Path(self.path(m["mountPath"]))
        where.mkdir(parents=True, exist_ok=True)
        if "configMap" in v:
            files = {k: v.encode() for k, v in self.configmaps[v["configMap"]["name"]].items()}
        elif "secret" in v:
            data = self.secrets[v["secret"]["secretName"]]
            items = v["secret"].get("items") or [{"key": k, "path": k} for k in data]
            files = {i["path"]: data[i["key"]] for i in items}
        else:
            assert "emptyDir" in v, v
            return
        for rel, content in files.items():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / rel).write_bytes(content)
            if "secret" in v:
                os.chmod(where / rel, v["secret"].get("defaultMode", 0o644))

    def rewrite(self, text: str, mounts: list[str]) -> str:
        """A path under a mount, moved under this pod's root (the longest mount first)."""
        for mount in sorted(mounts, key=len, reverse=True):
            if text == mount or text.startswith(mount + "/"):
                return self.path(mount) + text[len(mount):]
        return text

    def start(self, c: dict, hosts: dict[str, str], log: Path) -> subprocess.Popen:
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        for m in c["volumeMounts"]:
            self.mount(m)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.root / "tmp")}  # the pod's own /tmp
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            env[e["name"]] = self.secrets[ref["name"]][ref["key"]].decode() if ref else self.rewrite(e["value"], mounts)
        exe, *args = c["command"]
        argv = [str(Path(sys.executable).parent / Path(exe).name)]  # .venv/bin/X: the image's venv is ours
        argv += [",".join(hosts.get(h, h) for h in a.split(",")) if a.count(":") else hosts.get(a) or self.rewrite(a, mounts)
                 for a in args]
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)


def _run_layout(layout: str, tmp: Path, model_dir: Path) -> None:
    docs = render(DEPLOY / layout)
    agent_port, http_port = free_port(), free_port()
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    configmaps = {cm["metadata"]["name"]: _configmap(cm, model_dir, tmp, agent_port, http_port)}
    secrets = _secrets(tmp)
    # Each pod's own address: a loopback one that is not "local" to us (tcp + CURVE, as across pods),
    # where `--bind 0.0.0.0` listens; a Service's name:port is its pod's address on the agents' test port.
    deps = [d for d in docs if d["kind"] == "Deployment"]
    ips = {d["metadata"]["name"]: f"127.0.0.{2 + k}" for k, d in enumerate(deps)}
    hosts = {f"{s['metadata']['name']}:{p['port']}": f"{ips[d['metadata']['name']]}:{agent_port}"
             for s in docs if s["kind"] == "Service" for p in s["spec"]["ports"] if p["name"] == "agent"
             for d in deps if s["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()}
    procs: list[tuple[subprocess.Popen, Path]] = []
    server_log = tmp / "no-server.log"
    try:
        for dep in deps:
            pod = Pod(dep, tmp / dep["metadata"]["name"], configmaps, secrets)
            for c in pod.spec["containers"]:
                log = tmp / f"{dep['metadata']['name']}-{c['name']}.log"
                procs.append((pod.start(c, {**hosts, "0.0.0.0": ips[dep["metadata"]["name"]]}, log), log))
                server_log = log if c["command"][0].endswith("/llm-serving") else server_log
        deadline = time.monotonic() + READY_S
        while "llm-serving ready" not in server_log.read_text():
            dead = [log for p, log in procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, "\n".join(f"{log.name}:\n{log.read_text()[-2000:]}"
                                                                      for _, log in procs)
            time.sleep(0.2)
        url = f"http://127.0.0.1:{http_port}"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0},
                       headers={"Authorization": "Bearer change-me"}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        for p, _ in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)


@pytest.mark.parametrize("layout", ["base", "remote-agents", "pd-pods"])
def test_each_container_starts_with_its_manifests_files_and_serves(layout, tiny_model_dir):
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="pod-", dir="/tmp"))  # short: ipc socket paths stay under 107 bytes
    try:
        _run_layout(layout, root, tiny_model_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_launcher_without_its_keypair_says_so_in_one_line(tmp_path, tiny_model_dir):
    """launch_agents on tcp with a key folder that lacks agent.key_secret: one line, exit 1."""
    from tests.helpers import tiny_config

    (tmp_path / "keys" / "authorized").mkdir(parents=True)
    config = tiny_config(tmp_path, tiny_model_dir, curve_keys=str(tmp_path / "keys"))
    run = subprocess.run([sys.executable, "-m", "llm_serving.launch", "--config", str(config), "--bind", "0.0.0.0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "agent.key_secret not found" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr
