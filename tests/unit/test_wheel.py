"""The wheel users install holds the product: every module of its packages in the checkout and the
files they read (the kernels' sources, the chat page), and no tests. A package list written by hand
once left four agent folders out of it."""
from __future__ import annotations

import subprocess
import sys
import zipfile

from tests.helpers import ROOT

PRODUCT = ("agent", "common", "server", "shm", "llm_serving")


def test_the_wheel_holds_every_product_module_and_file(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, cwd=tmp_path, timeout=600)
    [wheel] = tmp_path.glob("llm_serving-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    want = {str(p.relative_to(ROOT)) for pkg in PRODUCT for p in (ROOT / pkg).rglob("*")
            if p.suffix in (".py", ".cpp", ".h", ".html", ".js", ".css", ".svg") and "__pycache__" not in p.parts}
    assert sorted(want - held) == []
    assert not any(name.startswith("tests/") for name in held)
