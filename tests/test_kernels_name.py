"""The bare name `kernels` belongs to the `kernels` distribution (transformers >= 5.25 imports it): the repository's
kernels/ folder is `compactionrl_fast.kernels` only, and from the repository root (on sys.path for scripts,
`python -c` and pytest) `import kernels` finds the distribution when one is installed, or fails as if the folder
were not there. `make test-newest` checks it with the real distribution and the newest transformers."""
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BARE = re.compile(r"^\s*(from\s+kernels[\s.]|import\s+kernels\b)|-m\s+kernels\b", re.M)


def run_from_root(code: str, extra_path=None) -> subprocess.CompletedProcess:
    """`python -c code` with the repository root as the working directory (sys.path[0]), `extra_path` after it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [extra_path, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


def test_bare_import_finds_the_installed_distribution(tmp_path):
    # a stand-in with the shape transformers uses: a package with a submodule and a name in __init__
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .layer import CUDAProperties\nWHO = 'distribution'\n")
    (pkg / "layer.py").write_text("class CUDAProperties:\n    pass\n")
    res = run_from_root(textwrap.dedent("""
        import kernels
        from kernels import CUDAProperties
        import compactionrl_fast.kernels as ours
        from compactionrl_fast.kernels import modes
        print(kernels.WHO, kernels.__file__, ours.__name__, modes.CROSS_PAPER)
    """), extra_path=str(tmp_path))
    assert res.returncode == 0, res.stderr
    who, path, ours, paper = res.stdout.split()
    assert (who, ours, paper) == ("distribution", "compactionrl_fast.kernels", "1")
    assert path == str(pkg / "__init__.py")


def test_bare_import_without_the_distribution_is_an_empty_namespace():
    # what Python gives for a folder without __init__.py: no file, no version, nothing under it; transformers
    # reads that as "kernels is not installed" (it imports the name to check)
    pytest.importorskip("transformers")
    try:
        pytest.skip(f"the kernels distribution {importlib.metadata.version('kernels')} is installed here (the "
                    "stand-in test and every transformers model built from the root cover that case)")
    except importlib.metadata.PackageNotFoundError:
        pass
    res = run_from_root(textwrap.dedent("""
        import kernels
        print(getattr(kernels, "__file__", None), list(kernels.__path__))
        from transformers.utils.import_utils import is_kernels_available
        print(is_kernels_available())
        import kernels.modes
    """))
    assert res.stdout.split("\n")[:2] == ["None []", "False"], res.stdout + res.stderr
    assert "ModuleNotFoundError: No module named 'kernels.modes'" in res.stderr, res.stderr
    res = run_from_root("import compactionrl_fast.kernels.gae_params, sys; print('kernels' in sys.modules)")
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_nothing_imports_the_bare_name():
    hits = []
    for top in ("compactionrl_fast", "kernels", "tests", "benchmarks", "examples", "docs", "csrc"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".md", ".h", ".sh")) and name != os.path.basename(__file__):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        hits += [f"{os.path.relpath(path, ROOT)}: {m.group(0).strip()}" for m in BARE.finditer(f.read())]
    for name in ("Makefile", "setup.py", "README.md", os.path.join(".ci", "run")):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            hits += [f"{name}: {m.group(0).strip()}" for m in BARE.finditer(f.read())]
    assert not hits, "imports of the bare name `kernels` (use compactionrl_fast.kernels):\n" + "\n".join(hits)


def test_write_header_command_runs(tmp_path):
    from compactionrl_fast.kernels import modes

    res = subprocess.run([sys.executable, "-m", "compactionrl_fast.kernels"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert res.returncode != 0 and modes.WRITE_HEADER in res.stderr, res.stderr
