"""The package's layers, read from its own imports (module-level and function-level alike, via `ast`).

Layers, lowest first; a module may import its own layer and the ones below, never one above:

    kernels < reference < ops < rollout < packing, envs < train < integrations < app

The package root (`compactionrl_fast/__init__.py`) is the public facade: it may load any layer, and no module
of the package imports it. Besides: no import cycle between modules, and `kernels/` (installed as
`compactionrl_fast.kernels`) is never imported by the bare name `kernels`, which belongs to another
distribution. docs/development.md shows the same order.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "compactionrl_fast"

# (module prefix under the package, layer): the longest matching prefix names a module's layer
LAYERS = {"kernels": 0, "reference": 1, "ops": 2, "rollout": 3, "packing": 4, "envs": 4, "train": 5,
          "integrations": 6, "app": 7, "__main__": 7}
LAYER_NAMES = {0: "kernels", 1: "reference", 2: "ops", 3: "rollout", 4: "packing/envs", 5: "train",
               6: "integrations", 7: "app"}


def package_files(root: str = ROOT) -> dict[str, str]:
    """Module name -> path for every .py file of the package (kernels/ lives at the repository root)."""
    out = {}
    for top, prefix in ((os.path.join(root, PKG), PKG), (os.path.join(root, "kernels"), PKG + ".kernels")):
        for d, _, files in os.walk(top):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), top)[:-3].replace(os.sep, ".")
                    name = prefix if rel == "__init__" else f"{prefix}.{rel.removesuffix('.__init__')}"
                    out[name] = os.path.join(d, f)
    return out


def imports_of(name: str, path: str, modules) -> list[tuple[str, int]]:
    """[(imported module, line)] of every import statement in the file, resolved to the package's modules.

    `from X import a` reads module X.a where that is a module of the package, else X itself. Imports of other
    distributions are left out except a bare `kernels`, kept as "kernels" so the test can name it."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            found += [(s, node.lineno) for s in subs]
            if len(subs) < len(node.names):
                found.append((base, node.lineno))
    return [(m, line) for m, line in found if m == PKG or m.startswith(PKG + ".") or m.split(".")[0] == "kernels"]


def layer_of(module: str) -> int | None:
    rest = module[len(PKG) + 1:].split(".")
    for n in range(len(rest), 0, -1):
        if ".".join(rest[:n]) in LAYERS:
            return LAYERS[".".join(rest[:n])]
    return None


def import_graph(root: str = ROOT) -> dict[str, list[tuple[str, int]]]:
    modules = package_files(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def problems(root: str = ROOT) -> list[str]:
    """Every breach of the rules above, one line each."""
    graph = import_graph(root)
    out = []
    for mod, deps in sorted(graph.items()):
        if mod == PKG:
            continue
        if layer_of(mod) is None:
            out.append(f"{mod}: in no layer (add it to LAYERS in tests/test_layers.py and docs/development.md)")
            continue
        for dep, line in deps:
            where = f"{mod}:{line}"
            if dep.split(".")[0] == "kernels":
                out.append(f"{where} imports the bare name {dep!r} (use compactionrl_fast.kernels)")
            elif dep == PKG:
                out.append(f"{where} imports the package root (import the module that defines the name)")
            elif (dl := layer_of(dep)) is not None and dl > layer_of(mod):
                out.append(f"{where} climbs from {LAYER_NAMES[layer_of(mod)]} up to {LAYER_NAMES[dl]} ({dep})")
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return out


def cycles(graph) -> list[list[str]]:
    """One cycle per strongly connected group of modules (Tarjan), as a list of module names."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, ()):
            if w not in graph or w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_layers_hold():
    assert problems() == []


def test_every_module_is_read():
    """The walk finds the layers' modules (a broken walk would pass test_layers_hold vacuously)."""
    graph = import_graph()
    assert {PKG + ".kernels.modes", PKG + ".ops.gae", PKG + ".train.trainer", PKG + ".app.cli"} <= set(graph)
    # train/trainer.py imports the ops inside its functions only: they are read too
    assert PKG + ".ops" in {d for d, _ in graph[PKG + ".train.trainer"]}


def _write(tmp, files: dict[str, str]):
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize("files, expect", [
    ({"train/a.py": "def f():\n    from ..app import cli\n", "app/cli.py": ""}, "climbs from train up to app"),
    ({"rollout/a.py": "from ..train.checkpoint import x\n", "train/checkpoint.py": ""}, "climbs from rollout"),
    ({"ops/a.py": "import kernels.modes\n"}, "bare name 'kernels.modes'"),
    ({"train/a.py": "from .b import x\n", "train/b.py": "from . import a\n"}, "import cycle"),
    ({"train/a.py": "from .. import _io\n", "_io.py": ""}, "in no layer"),
    ({"train/a.py": "from .. import __version__\n"}, "imports the package root"),
    ({"app/a.py": "from ..ops import gae\n", "ops/gae.py": ""}, None),
])
def test_rules_catch_breaches(tmp_path, files, expect):
    _write(tmp_path / PKG, {"__init__.py": "", **files})
    found = problems(str(tmp_path))
    if expect is None:
        assert found == []
    else:
        assert any(expect in p for p in found), found
