"""The original's `python examples/server_app_post.py --config X.yaml`: the HTTP server for agents
already started by start_agent.py (`llm-serving --attach`). Same arguments as llm-serving."""
import sys

import _path  # noqa: F401  (the project root on sys.path)
from llm_serving.serve import main

if __name__ == "__main__":
    sys.exit(main(["--attach", *sys.argv[1:]]))
