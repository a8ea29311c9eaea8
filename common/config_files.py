"""The serving YAML as a document: read (a missing file or a syntax error named), its sections, and
the original GE backend's `model_path` section, which names graphs, not weights (common/config.py
reads the keys)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from common.config_checks import ConfigError

if TYPE_CHECKING:
    from common.config import ServingConfig


def section(doc: dict[str, Any], name: str) -> dict[str, Any]:
    body = doc.get(name) or {}
    if not isinstance(body, dict):
        raise ConfigError(f"{name}: must be a mapping of keys, not {type(body).__name__}")
    return body


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML document at `path`; a missing file or a syntax error is a ConfigError naming it."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    if doc is not None and not isinstance(doc, dict):
        raise ConfigError(f"config file {path}: expected sections (model_config, serving_config, ...), "
                          f"not {type(doc).__name__}")
    return doc or {}


def ge_graphs(graphs_section: Any, c: "ServingConfig", sections: dict[str, dict[str, Any]]) -> None:
    """The original GE backend's `model_path` section: MindIR graphs per rank (`prefill_model`,
    `decode_model`, one per agent port: the ranks of one model). They are Ascend-compiled graphs,
    not weights: the same model is served from its weights (model_cfg_path or model_path) as that
    many tensor-parallel ranks; without weights, or with another rank count, the config is refused."""
    graphs = graphs_section.get("prefill_model") if isinstance(graphs_section, dict) else None
    ranks = len(graphs) if isinstance(graphs, list) else 1
    mc = sections["model_config"]
    if not (mc.get("model_cfg_path") or mc.get("model_path")):
        raise ConfigError("model_path: the GE backend's MindIR graphs cannot be served here (they are Ascend-compiled "
                          "graphs, not weights); set model_config.model_cfg_path (the MindFormers yaml naming the "
                          "checkpoint) or model_config.model_path to serve the same model")
    if len(c.agent_ports) % ranks:
        raise ConfigError(f"model_path: {ranks} graphs per kind (ranks) for {len(c.agent_ports)} agent_ports: "
                          "each port must be one rank of a model")
    if "tensor_parallel_size" not in sections["serving_config"]:
        c.tensor_parallel_size = ranks
    c.notices.append(f"model_path: the GE graphs are not used; the model's weights are served as "
                     f"{c.tensor_parallel_size} tensor-parallel rank(s) per replica")
