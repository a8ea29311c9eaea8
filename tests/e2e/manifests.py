"""deploy/'s Kubernetes manifests as `kubectl kustomize` builds them, for the tests that check
and run them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.helpers import ROOT


DEPLOY = ROOT / "deploy"


def render(folder: Path) -> list[dict[str, Any]]:
    """A kustomization's resources, its sub-kustomizations included, and its strategic-merge patches
    (what `kubectl kustomize` builds)."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for res in kust["resources"]:
        path = (folder / res).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kust.get("patches", []):
        p = yaml.safe_load((folder / patch["path"]).read_text())
        [target] = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (p["kind"], p["metadata"]["name"])]
        _merge(target, p)
    return docs


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    """Strategic merge as Kubernetes does it for these fields: maps key by key, lists of named items
    item by name, anything else replaced."""
    for key, value in patch.items():
        old = into.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            _merge(old, value)
        elif isinstance(old, list) and isinstance(value, list) and all(isinstance(v, dict) and "name" in v for v in value):
            for item in value:
                match = [o for o in old if o.get("name") == item["name"]]
                if match:
                    _merge(match[0], item)
                else:
                    old.append(item)
        else:
            into[key] = value
