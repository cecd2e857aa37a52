"""What an install of sifar-jax makes importable: the package `sifar_jax`, and not the checkout's
`models`, `bench` and `tests`, which run from a checkout (README, "Set-up").

An editable install (scikit-build-core) puts, besides its import hook, the directory holding the
package on sys.path through its .pth file. With the package at the top of the checkout that
directory was the checkout, and `import tests` worked from anywhere; the package lives in src/ so
that it is src/. Checked against the installed distribution (its files and a fresh interpreter
outside the checkout), without a rebuild; skipped where sifar-jax is not installed (a checkout
run with PYTHONPATH=src).
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKOUT_PACKAGES = ("models", "bench", "tests")


@pytest.fixture(scope="module")
def dist():
    try:
        return importlib.metadata.distribution("sifar-jax")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sifar-jax is not installed in this environment")


def _importable_names(directory: pathlib.Path) -> set[str]:
    """The top-level names a sys.path entry offers: packages (namespace ones included) and
    modules."""
    names = set()
    for p in directory.iterdir():
        if p.is_dir() and p.name.isidentifier() and p.name != "__pycache__":
            names.add(p.name)
        elif p.is_file() and p.suffix in (".py", ".so"):
            names.add(p.name.split(".")[0])
    return names


def test_the_pth_files_add_no_directory_but_the_package_s_own(dist):
    """Every directory an installed .pth adds to sys.path offers `sifar_jax` alone."""
    pth_files = [f for f in dist.files if f.suffix == ".pth"]
    if not pth_files:
        pytest.skip("not an editable install: no .pth file")
    for pth in pth_files:
        base = pathlib.Path(dist.locate_file(pth)).parent
        for line in pathlib.Path(dist.locate_file(pth)).read_text().splitlines():
            if not line.strip() or line.startswith(("#", "import ", "import\t")):
                continue
            entry = (base / line.strip()).resolve()
            if entry.is_dir():
                assert _importable_names(entry) == {"sifar_jax"}, (pth.name, str(entry))


def test_outside_the_checkout_only_sifar_jax_imports(dist, tmp_path):
    """A fresh interpreter (-E: no PYTHONPATH) in an empty directory finds sifar_jax, and finds
    models, bench and tests nowhere in this checkout (another distribution's top-level `tests`
    is not ours to judge)."""
    code = (
        "import importlib.util, json, sys\n"
        "def where(name):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    return None if spec is None else list(spec.submodule_search_locations or [spec.origin])\n"
        "print(json.dumps({n: where(n) for n in sys.argv[1:]}))\n"
    )
    r = subprocess.run([sys.executable, "-E", "-c", code, "sifar_jax", *CHECKOUT_PACKAGES],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["sifar_jax"], "sifar_jax is installed but not importable outside the checkout"
    for name in CHECKOUT_PACKAGES:
        leaked = [loc for loc in found[name] or [] if pathlib.Path(loc).resolve().is_relative_to(ROOT)]
        assert not leaked, f"`import {name}` finds the checkout's {leaked} outside the checkout"
