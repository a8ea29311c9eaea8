"""Agent endpoints: a runtime folder whose socket path a unix socket cannot take is refused by name."""
from __future__ import annotations

import pytest

from common.config import ConfigError
from shm.endpoint import SUN_PATH_MAX, agent_address, socket_path


def test_a_socket_path_too_long_is_a_config_error_naming_the_folder_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_SERVING_RUNTIME_DIR", str(tmp_path / ("x" * SUN_PATH_MAX)))
    with pytest.raises(ConfigError, match="LLM_SERVING_RUNTIME_DIR"):
        agent_address(61166)
    assert agent_address(61166, "10.0.0.1") == "tcp://10.0.0.1:61166"  # tcp agents have no socket file
    monkeypatch.setenv("LLM_SERVING_RUNTIME_DIR", str(tmp_path))
    assert len(str(socket_path(61166)).encode()) <= SUN_PATH_MAX
