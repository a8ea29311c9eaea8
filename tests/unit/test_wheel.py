"""The wheel users install holds the product: every module of its packages in the checkout and the
files they read (the kernels' sources, the chat page), and no tests. A package list written by hand
once left four agent folders out of it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

from tests.helpers import ROOT

PRODUCT = ("agent", "common", "server", "shm", "llm_serving")


def test_the_wheel_holds_every_product_module_and_file(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools builds in the tree, and a build/ left there would be packed again
    ignore = shutil.ignore_patterns("__pycache__", "fixtures")
    for name in (*PRODUCT, "tools", "tests"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, cwd=tmp_path, timeout=600)
    [wheel] = tmp_path.glob("llm_serving-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    want = {str(p.relative_to(ROOT)) for pkg in PRODUCT for p in (ROOT / pkg).rglob("*")
            if p.suffix in (".py", ".cpp", ".h", ".html", ".js", ".css", ".svg") and "__pycache__" not in p.parts}
    assert sorted(want - held) == []
    assert not any(name.startswith(("tests/", "tools/")) for name in held)
    _installed_imports(tmp_path, wheel, want)


def _installed_imports(tmp_path, wheel, files: set[str]) -> None:
    """The wheel installed into a fresh venv (its dependencies read from this one's site-packages, whose
    editable install of the checkout is not processed there) imports every product module from the
    venv, run outside the checkout."""
    import site
    import venv

    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    [own] = env.glob("lib/python*/site-packages")
    (own / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    with zipfile.ZipFile(wheel) as z:  # what `pip install --no-deps` puts in site-packages
        z.extractall(own)
    modules = sorted(".".join(p[:-3].split("/")).removesuffix(".__init__") for p in files if p.endswith(".py"))
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    f = importlib.import_module(m).__file__\n"
            f"    assert f.startswith({str(own)!r}), (m, f)\n"
            "print(len(sys.modules))")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
    out = subprocess.run([str(env / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=clean)
    assert out.returncode == 0, out.stderr[-3000:]
