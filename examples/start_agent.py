"""The original's `python examples/start_agent.py --config X.yaml`: start one agent per
`serving_config.agent_ports` entry and keep them up (`launch_agents`; prints "all agents started",
restarts an agent that dies, stops them all on SIGTERM/Ctrl-C). Same arguments as launch_agents."""
import sys

import _path  # noqa: F401  (the project root on sys.path)
from llm_serving.launch import main

if __name__ == "__main__":
    sys.exit(main())
