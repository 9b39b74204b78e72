"""The docs hold together: every relative link resolves inside the repository, the results index names
every results file, and the public ops' docstring examples run."""
import doctest
import glob
import importlib
import os
import pkgutil
import re

import pytest

import compactionrl_fast.ops as ops_pkg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGES = (["README.md", "benchmarks/results/README.md", "benchmarks/experiments/README.md"]
         + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _links(page: str) -> list:
    with open(os.path.join(ROOT, page)) as f:
        return LINK.findall(f.read())


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve_inside_the_repository(page):
    bad = []
    for link in _links(page):
        if link.startswith("#"):
            continue
        if "://" in link or link.startswith(("/", "mailto:")):
            bad.append(f"{link} (points outside the repository)")
            continue
        target = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), link.split("#", 1)[0]))
        if os.path.commonpath([target, ROOT]) != ROOT:
            bad.append(f"{link} (outside the repository)")
        elif not os.path.exists(target):
            bad.append(f"{link} (missing)")
    assert not bad, f"{page}: " + ", ".join(bad)


def _listed_stems() -> list:
    """The file names the results index lists, without `{...}` alternatives and extensions."""
    with open(os.path.join(RESULTS, "README.md")) as f:
        names = re.findall(r"`([A-Za-z0-9_.{},*-]+)`", f.read())
    return [re.split(r"[.{*]", n)[0] for n in names if re.split(r"[.{*]", n)[0]]


def test_results_index_names_every_results_file():
    stems = _listed_stems()
    missing = [f for f in sorted(os.listdir(RESULTS)) if f != "README.md"
               and not any(f.startswith(s) for s in stems)]
    assert not missing, f"benchmarks/results/README.md does not list {missing}"


@pytest.mark.parametrize("name", sorted(m.name for m in pkgutil.iter_modules(ops_pkg.__path__)
                                        if not m.name.startswith("_")))
def test_op_docstring_examples(name):
    mod = importlib.import_module(f"compactionrl_fast.ops.{name}")
    res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert res.failed == 0
