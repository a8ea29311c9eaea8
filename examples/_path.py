"""The examples run from a checkout as the original's did (`python examples/X.py`): the project
root goes on the import path whether or not the project is installed."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
