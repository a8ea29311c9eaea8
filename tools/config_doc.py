"""Rewrite docs/config.md's key tables from the config table (common/config_keys.py KEYS):
`python -m tools.config_doc` (tests/unit/test_config.py checks the doc is up to date)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from common.config import ServingConfig
from common.config_keys import SECTIONS
from common.config_text import markdown

DOC = Path(__file__).resolve().parent.parent / "docs/config.md"
MARK = re.compile(r"(<!-- table: (\w+) [^\n]*-->\n).*?(<!-- end -->)", re.S)


def render(text: str) -> str:
    """`text` with each marked table replaced by its section's rows."""
    return MARK.sub(lambda m: m.group(1) + markdown(m.group(2), ServingConfig()) + "\n" + m.group(3), text)


def main() -> int:
    text = DOC.read_text()
    missing = [s for s in SECTIONS if f"<!-- table: {s} " not in text]
    if missing:
        print(f"docs/config.md has no table marker for {missing}", file=sys.stderr)
        return 1
    DOC.write_text(render(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
