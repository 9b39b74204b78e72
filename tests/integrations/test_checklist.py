"""Every framework integration has each of its pieces (docs/adding-an-integration.md), as every op has its own
(tests/ops/test_registry.py).

Each package compactionrl_fast/integrations/<name>/ declares an `IntegrationSpec` (integrations/_registry.py);
`missing(spec)` says, one sentence a piece, what the integration lacks: its docs page with "What ran here" (and
its line in docs/README.md), piece tests against the float64 reference through the framework's real code, a
whole-job test run by a Makefile target that CI stages, bad-input tests on every rank, the recipe's metrics
(docs/metrics.md's vocabulary) in the framework's logger. `test_missing_notices_each_piece` removes each piece in
turn to show the check can fail; `python -m tests.integrations.test_checklist NAME` prints the list for an
integration (a stub with nothing: every line).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import pkgutil
import re
import sys

import pytest

import compactionrl_fast.integrations as integrations_pkg
from compactionrl_fast.integrations._registry import NOT_INTEGRATIONS, SPECS, IntegrationSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(path):
    full = os.path.join(ROOT, path)
    return open(full).read() if os.path.isfile(full) else None


def _test_exists(node):
    """Whether "file::function" names a test function defined at the top of that file."""
    path, _, fn = node.partition("::")
    src = _read(path)
    if src is None or not fn:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == fn
               for n in ast.parse(src).body)


def _with_helpers(path):
    """A test file's source and that of the sibling modules it imports (`from . import _harness as H`)."""
    src = _read(path) or ""
    folder = os.path.dirname(path)
    names = re.findall(r"^from \.(?: import (\w+)|(\w+) import)", src, re.M)
    return src + "".join(_read(os.path.join(folder, (a or b) + ".py")) or "" for a, b in names)


def _uses_framework(src, fw):
    """Whether a test file imports the framework (or skips itself without it, then imports it)."""
    fw = re.escape(fw)
    return re.search(rf"^\s*(from|import) {fw}\b|importorskip\(\"{fw}\b|skip_without_{fw}\(", src, re.M) is not None


def _make_runs(target, path):
    """Whether the Makefile has `target` and its recipe names `path` (the file or its folder)."""
    mk = _read("Makefile") or ""
    body = re.search(rf"^{re.escape(target)}:.*?\n((?:\t.*\n|.*\\\n)+)", mk, re.M)
    folder = os.path.dirname(path)
    return bool(body) and (path in body.group(1) or re.search(rf"{re.escape(folder)}(\s|$)", body.group(1)) is not None)


def missing(spec: IntegrationSpec) -> list[str]:
    """The pieces `spec` lacks, each a sentence naming what to write or edit."""
    name, out = spec.name, []
    pkg = f"compactionrl_fast/integrations/{name}/__init__.py"
    if _read(pkg) is None:
        out.append(f"package: {pkg} (the integration's modules, its SPEC)")
    doc = _read(f"docs/{name}.md")
    if doc is None:
        out.append(f"docs: docs/{name}.md (how users turn it on, the config keys, errors, What ran here)")
    else:
        if not re.search(r"^## What ran here", doc, re.M):
            out.append(f"docs: a '## What ran here' section in docs/{name}.md (what runs on CPU in CI, what needs a "
                       "GPU, the stand-ins and why)")
        if spec.make_target and f"make {spec.make_target}" not in doc:
            out.append(f"docs: docs/{name}.md names the job test's command `make {spec.make_target}`")
        if "metrics.md" not in doc:
            out.append(f"docs: docs/{name}.md links the metrics vocabulary (metrics.md)")
    if f"({name}.md)" not in (_read("docs/README.md") or ""):
        out.append(f"docs: a row for {name}.md in docs/README.md")
    if not spec.reference_tests:
        out.append("reference tests: tests that run the plug-in through the framework's real code against the "
                   "float64 reference (IntegrationSpec.reference_tests)")
    for node in spec.reference_tests:
        src = _with_helpers(node.partition("::")[0])
        if not _test_exists(node):
            out.append(f"reference tests: {node} does not exist")
        elif "compactionrl_fast.reference" not in src and "crf.reference" not in src:
            out.append(f"reference tests: {node.partition('::')[0]} does not compare with compactionrl_fast.reference")
        elif not _uses_framework(src, spec.framework):
            out.append(f"reference tests: {node.partition('::')[0]} does not use {spec.framework}'s real code")
    if not spec.job_test:
        out.append(f"job test: tests/integrations/{name}/job/test_job.py, the job users launch through "
                   f"{spec.framework}'s own entry point (IntegrationSpec.job_test)")
    elif _read(spec.job_test) is None:
        out.append(f"job test: {spec.job_test} does not exist")
    if not spec.make_target:
        out.append(f"job test: a Makefile target that runs it (IntegrationSpec.make_target, e.g. test-{name}-job)")
    elif spec.job_test and not _make_runs(spec.make_target, spec.job_test):
        out.append(f"job test: Makefile target {spec.make_target} running {spec.job_test}")
    if spec.make_target and not re.search(rf"^stage {re.escape(spec.make_target)}\b", _read(".ci/run") or "", re.M):
        out.append(f"CI: `stage {spec.make_target}` in .ci/run")
    if not spec.bad_input_tests:
        out.append("bad input: tests that bad input stops every rank with a clear error, not a hang "
                   "(IntegrationSpec.bad_input_tests)")
    out += [f"bad input: {n} does not exist" for n in spec.bad_input_tests if not _test_exists(n)]
    if not spec.metrics:
        out.append("metrics: the function that hands the recipe's metrics to the framework's logger "
                   "(IntegrationSpec.metrics, 'module:function')")
    else:
        mod, _, fn = spec.metrics.partition(":")
        try:
            m = importlib.import_module(mod)
            if not callable(getattr(m, fn, None)):
                raise AttributeError(fn)
            src = open(m.__file__).read()
        except (ImportError, AttributeError) as e:
            out.append(f"metrics: {spec.metrics} cannot be imported ({type(e).__name__}: {e})")
        else:
            if "rollout.metrics" not in src and "recipe_metrics" not in src:
                out.append(f"metrics: {mod} computes its own names; use the vocabulary's function "
                           "(compactionrl_fast.rollout.metrics)")
    if not spec.metrics_tests:
        out.append("metrics: tests that the framework's logger gets exactly the vocabulary's names "
                   "(IntegrationSpec.metrics_tests)")
    out += [f"metrics: {n} does not exist" for n in spec.metrics_tests if not _test_exists(n)]
    return out


def integration_packages():
    """The subpackages of compactionrl_fast.integrations (the op adapters beside them are modules)."""
    return sorted(m.name for m in pkgutil.iter_modules(integrations_pkg.__path__) if m.ispkg)


def test_every_integration_package_declares_a_spec():
    for name in integration_packages():
        importlib.import_module(f"compactionrl_fast.integrations.{name}")
        assert name in SPECS, f"compactionrl_fast/integrations/{name}/__init__.py declares no IntegrationSpec"
    assert not set(NOT_INTEGRATIONS) & set(integration_packages())
    assert set(integration_packages()) == {"slime", "verl"}


@pytest.mark.parametrize("name", ["verl", "slime"])
def test_each_integration_has_every_piece(name):
    importlib.import_module(f"compactionrl_fast.integrations.{name}")
    assert missing(SPECS[name]) == []


PIECES = {  # field -> an empty value, and a word the sentence about it must hold
    "reference_tests": ((), "reference tests"), "job_test": ("", "job test"), "make_target": ("", "Makefile target"),
    "bad_input_tests": ((), "bad input"), "metrics": ("", "metrics"), "metrics_tests": ((), "metrics"),
}


@pytest.mark.parametrize("field", sorted(PIECES))
def test_missing_notices_each_piece(field):
    importlib.import_module("compactionrl_fast.integrations.verl")
    empty, word = PIECES[field]
    out = missing(dataclasses.replace(SPECS["verl"], **{field: empty}))
    assert out and all(word in line or "CI" in line or "docs" in line for line in out), out
    # a test named that does not exist
    if isinstance(empty, tuple):
        out = missing(dataclasses.replace(SPECS["verl"], **{field: ("tests/integrations/verl/test_agent.py::nope",)}))
        assert any("nope does not exist" in line for line in out), out


def test_a_stub_integration_gets_the_whole_list():
    out = missing(IntegrationSpec(name="stub", framework="stubframework"))
    text = "\n".join(out)
    for word in ("package:", "docs: docs/stub.md", "docs: a row", "reference tests:", "job test:", "bad input:",
                 "metrics:"):
        assert word in text, text


def main(argv):
    for name in argv or sorted(SPECS):
        spec = SPECS.get(name) or IntegrationSpec(name=name, framework=name)
        lines = missing(spec)
        print(f"{name}: " + ("complete" if not lines else f"{len(lines)} missing"))
        for line in lines:
            print(f"  - {line}")


if __name__ == "__main__":
    for pkg in integration_packages():
        importlib.import_module(f"compactionrl_fast.integrations.{pkg}")
    main(sys.argv[1:])
