"""README's layout table names every module of the product's packages, each in its package's row."""
from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT

PACKAGES = ("common", "shm", "agent", "agent/lora", "agent/model", "agent/speculative", "agent/weights", "server", "server/sched",
            "server/engine", "server/http", "llm_serving")


def _rows() -> dict[str, str]:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout"):readme.index("### Life of a request")]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_/]+)/` \| (.*) \|$", table, re.M)}


@pytest.mark.parametrize("package", PACKAGES)
def test_layout_table_names_every_module_once(package):
    modules = sorted(p.name for p in (ROOT / package).glob("*.py") if p.name != "__init__.py")
    named = re.findall(r"`([a-z_0-9]+\.py)`", _rows()[package])
    assert sorted(set(named)) == sorted(named), f"{package}: a module named twice"
    assert sorted(named) == modules, f"{package}: the README's row and the folder differ"


def test_every_path_in_the_feature_table_exists():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("**Features**"):readme.index("### Life of a request")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| feature")]
    paths = re.findall(r"`((?:common|shm|agent|server|llm_serving|tools|tests)/[a-z_/0-9]*(?:\.py)?)`", table)
    assert len(rows) >= 4 and len(paths) >= 20
    assert [p for p in paths if not (ROOT / p).exists()] == []
