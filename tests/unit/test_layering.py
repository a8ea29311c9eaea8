"""Layering: common <- shm <- {server <- server.sched <- server.engine <- server.http, agent} <-
llm_serving (entry points) <- tools. The server never loads mindspore or agent code, and only shm/
knows the arena's fields by name. An import under `if TYPE_CHECKING:` names a type for annotations
only and is not a dependency."""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from shm.step import SECTIONS
from tests.helpers import ROOT

ALLOWED = {  # unit -> the project units it may import (at module level or inside functions)
    "common": set(),
    "shm": {"common"},
    "server": {"common", "shm"},  # the shared nouns at the top of server/: request, sampling params, ...
    "server.sched": {"common", "shm", "server"},  # the scheduler's room: scheduler, sequence, block manager, ...
    "server.engine": {"common", "shm", "server", "server.sched"},
    "server.http": {"common", "shm", "server", "server.engine"},
    "agent": {"common", "shm"},
    "llm_serving": {"common", "shm", "server", "server.sched", "server.engine", "server.http", "agent"},
}
UNITS = set(ALLOWED) | {"tools", "tests"}


def _unit(module: str) -> str | None:
    """The longest unit a dotted module name falls in (server.http.app -> server.http)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in UNITS:
            return ".".join(parts[:n])
    return None


def _imports(path: Path) -> set[str]:
    """Every module a file imports, dotted (`from server.http import app` names server.http.app)."""
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _modules(pkg: str) -> list[tuple[str, Path]]:
    """(dotted name, path) of every module under a package, subpackages included."""
    return [(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"), p)
            for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_no_import_climbs_a_layer():
    wrong = []
    for unit, allowed in ALLOWED.items():
        for name, path in _modules(unit.replace(".", "/")):
            if _unit(name) != unit:  # a subpackage's own rule applies to it
                continue
            bad = {u for u in map(_unit, _imports(path)) if u is not None} - allowed - {unit}
            wrong += [f"{path.relative_to(ROOT)} imports {b}" for b in sorted(bad)]
    assert wrong == []


ROOMS = {  # agent's rooms -> the agent modules they may import (their own room aside)
    "agent.model_config": set(),  # at the bottom: every part of the model takes one
    "agent.model": {"agent.model_config", "agent.kernels"},
    "agent.weights": {"agent.model_config", "agent.model.quant", "agent.model.blocks"},  # the formats stored rows keep
    "agent.lora": {"agent.model_config", "agent.weights", "agent.model.lora"},  # adapter files, into the model's slots
    # proposers and the verification: what a step and its sequences are, and a draft model's own runner
    "agent.speculative": {"agent.runner_config", "agent.sequences", "agent.sampling", "agent.logits_dump",
                          "agent.runner", "agent.weights", "agent.model.calibrate", "agent.tensor_parallel"},
}


def test_agent_rooms_import_only_downwards():
    """The model never reads files, the weights never build a model, the config needs neither."""
    wrong = []
    for room, allowed in ROOMS.items():
        files = [(room, ROOT / "agent/model_config.py")] if room == "agent.model_config" \
            else _modules(room.replace(".", "/"))
        for _, path in files:
            wrong += [f"{path.relative_to(ROOT)} imports {imp}" for imp in sorted(_imports(path))
                      if imp.startswith("agent.") and not imp.startswith(room + ".")
                      and not any(imp.startswith(a + ".") for a in allowed)]
    assert wrong == []


def test_the_layer_rules_see_subpackages():
    assert _unit("server.http.app") == "server.http" and _unit("server.sched.scheduler") == "server.sched"
    assert "server.engine.engine" in {n for n, _ in _modules("server")}
    assert _unit(next(iter(_imports(ROOT / "server/http/app.py") & {"server.engine.engine.Engine"}))) == "server.engine"


def test_importing_every_server_module_loads_neither_mindspore_nor_agent():
    modules = [name for name, _ in _modules("server")]
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mindspore', 'agent', 'llm_serving')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_arena_field_is_named_by_a_string_outside_shm():
    """In every module that touches the arena (imports shm, or is agent code); HTTP clients in tools/
    read JSON keys such as "logprobs" that happen to share a field's name."""
    names = {f.name for section in SECTIONS for f in fields(section)}
    hits = []
    for pkg in ("server", "agent", "llm_serving", "common", "tools"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if pkg == "tools" and "shm" not in {_unit(m) for m in _imports(path)}:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in names:
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno} [{node.slice.value!r}]")
    assert hits == []


def test_a_sampling_knob_the_contract_encodes_must_exist_at_import():
    from dataclasses import dataclass

    import pytest

    from shm.step import check_params

    with pytest.raises(TypeError, match="top_p"):
        @check_params
        @dataclass
        class Params:  # noqa: F841 - the decorator is what is tested
            temperature: float = 0.0
            top_k: int = 0
            min_p: float = 0.0
            repetition_penalty: float = 1.0
            presence_penalty: float = 0.0
            frequency_penalty: float = 0.0
            seed: int | None = None
            logprobs: int = 0


def test_an_agent_process_loads_mindspore_only_once_it_is_pinned():
    """agent/main.py pins the process, caps the ISA and fixes its entry script before MindSpore
    loads (`agent.boot`): importing it, and the protocol server it serves with, loads none (an
    import of the LoRA room once did, and agents spawned by `python -c` failed to build graphs)."""
    code = "import sys, agent.main, agent.server; print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
