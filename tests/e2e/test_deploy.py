"""deploy/: the Kubernetes manifests pass the Kubernetes schemas (offline, kubernetes-validate), and
what they name exists: probe paths among the app's routes, ports in the serving YAML they mount,
the shared process namespace, runtime folder and /dev/shm the two containers of a pod need."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from common.config import load_config
from tests.e2e.manifests import DEPLOY, render
from tests.helpers import ROOT

K8S_VERSION = "1.30.0"


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _serving_config(docs: list[dict], tmp_path: Path) -> Any:
    [cm] = _by_kind(docs, "ConfigMap")
    path = tmp_path / "serving.yaml"
    path.write_text(cm["data"]["serving.yaml"])
    return load_config(path)


@pytest.mark.parametrize("layout", ["base", "remote-agents", "pd", "pd-pods"])
def test_manifests_pass_the_kubernetes_schemas(layout):
    docs = render(DEPLOY / layout)
    assert {"ConfigMap", "Secret", "Deployment", "Service"} <= {d["kind"] for d in docs}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _app_paths() -> set[str]:
    from common.config import ServingConfig
    from server.http.app import build_app

    return set(build_app(None, ServingConfig(), None).openapi()["paths"])  # the routes only: nothing runs


@pytest.mark.parametrize("layout", ["base", "remote-agents", "pd", "pd-pods"])
def test_probes_ports_and_mounts_exist_in_the_app_and_config(layout, tmp_path):
    docs = render(DEPLOY / layout)
    cfg = _serving_config(docs, tmp_path)
    paths = _app_paths()
    services = _by_kind(docs, "Service")
    for dep in _by_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        for c in pod["spec"]["containers"]:
            assert "/etc/llm-serving/serving.yaml" in c["command"]  # the ConfigMap's key, where it is mounted
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert volumes[mounts["/etc/llm-serving"]]["configMap"]["name"] == "llm-serving-config"
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    get = c[probe]["httpGet"]
                    assert get["path"] in paths and ports[get["port"]] == cfg.server_port
            if "http" in ports:
                assert ports["http"] == cfg.server_port
                assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.server_port)
                assert pod["metadata"]["annotations"]["prometheus.io/path"] in paths
            if "agent" in ports:
                assert ports["agent"] == cfg.agent_ports[0] and "--bind" in c["command"]
            if "--agents" in c["command"]:
                for agent in c["command"][c["command"].index("--agents") + 1].split(","):
                    host, port = agent.split(":")
                    assert any(s["metadata"]["name"] == host and s["spec"]["ports"][0]["port"] == int(port)
                               for s in services)
        if len(pod["spec"]["containers"]) == 2:  # agents + server in one pod: what they share
            assert pod["spec"]["shareProcessNamespace"] is True  # each checks the other's pid
            for c in pod["spec"]["containers"]:
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert mounts[env["LLM_SERVING_RUNTIME_DIR"]] == "runtime"
    for svc in services:
        selected = [d for d in _by_kind(docs, "Deployment")
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        names = {p["name"] for d in selected for c in d["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        assert selected and all(p["targetPort"] in names for p in svc["spec"]["ports"])


def test_the_pd_layout_runs_a_prefill_and_a_decode_agent_in_one_pod(tmp_path):
    docs = render(DEPLOY / "pd")
    cfg = _serving_config(docs, tmp_path)
    assert cfg.disaggregated and [cfg.role(i) for i in range(len(cfg.agent_ports))] == ["prefill", "decode"]
    [dep] = _by_kind(docs, "Deployment")
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"agents", "server"} and containers["agents"]["resources"]["limits"]["memory"] == "6Gi"
    assert containers["server"]["startupProbe"]["httpGet"]["path"] == "/health"  # the base's, kept by the merge


def test_the_pd_pods_layout_attaches_a_prefill_pod_and_a_decode_pod(tmp_path):
    from common.config_values import as_roles
    from llm_serving.serve import configure, parser

    docs = render(DEPLOY / "pd-pods")
    [server] = [d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"] == "llm-serving-server"]
    [c] = server["spec"]["template"]["spec"]["containers"]
    _serving_config(docs, tmp_path)
    args = [str(tmp_path / "serving.yaml") if a == "/etc/llm-serving/serving.yaml" else a for a in c["command"][1:]]
    parsed = parser().parse_args(args)
    cfg = configure(parsed, {"agent_roles": as_roles(parsed.agent_roles)})
    assert [(cfg.agent_host(i), cfg.role(i)) for i in range(2)] == [("llm-serving-agents", "prefill"),
                                                                    ("llm-serving-decode", "decode")]
    assert {d["metadata"]["name"] for d in _by_kind(docs, "Service")} >= {"llm-serving-agents", "llm-serving-decode"}


def test_the_image_is_the_readmes_set_up():
    steps = (ROOT / "Dockerfile").read_text()
    assert "bash tools/setup.sh" in steps and "bash tools/setup.sh" in (ROOT / "README.md").read_text()
    assert ".venv" in (ROOT / ".dockerignore").read_text()
