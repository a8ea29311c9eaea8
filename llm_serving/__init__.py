"""llm-serving: `from llm_serving import LLM, SamplingParams` for offline batch generation; the
`llm-serving` and `launch_agents` commands live in serve.py and launch.py.

Imported lazily: `python -m llm_serving.serve` must not find its own module already loaded."""
from typing import Any

__all__ = ["LLM", "Completion", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "Completion"):
        from llm_serving import offline

        return getattr(offline, name)
    if name == "SamplingParams":
        from server.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'llm_serving' has no attribute {name!r}")
