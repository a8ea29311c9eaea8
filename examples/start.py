"""The original's `python examples/start.py --config X.yaml`: agents and HTTP server in one command
(`llm-serving`: it starts the agents, waits for each, then serves; they stop with it). Same
arguments as llm-serving."""
import sys

import _path  # noqa: F401  (the project root on sys.path)
from llm_serving.serve import main

if __name__ == "__main__":
    sys.exit(main())
