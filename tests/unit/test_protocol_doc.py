"""docs/protocol.md describes the protocol version the code speaks: its title and its versioning
section name shm.protocol.VERSION (they drifted to 4 and 3 while the code spoke 5)."""
from __future__ import annotations

import re

from shm.protocol import VERSION
from tests.helpers import ROOT


def test_protocol_page_names_the_version_the_code_speaks():
    page = (ROOT / "docs" / "protocol.md").read_text()
    assert re.match(r"# The agent protocol \(version (\d+)\)", page).group(1) == str(VERSION)
    assert re.search(r"Version (\d+) \(this\s+page\)", page).group(1) == str(VERSION)
    assert f"must equal the agent's: {VERSION})" in page
