"""Test setup. The Triton kernels are tested on CPU tensors under the Triton interpreter, which must be
switched on before triton is first imported; the ahead-of-time compile tests run in a subprocess
without it (tests/_aot.py)."""
import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ["COMPACTIONRL_FAST_POISON"] = "1"  # outputs start as NaN: unwritten elements fail

import pytest  # noqa: E402
import torch  # noqa: E402

try:  # the interpreter runs a custom-combine scan one element at a time; swap in a log-step scan
    from tests import _interp_scan

    _interp_scan.install()
except ImportError:  # triton not installed
    pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# tokenizers/transformers are test dependencies (pip install -e ".[test]"), not dependencies of the package:
# without them the tests that need them are skipped with the reason, never collection errors or failures.
OPTIONAL = ("tokenizers", "transformers")
_NO_MODULE = re.compile(r"No module named '(%s)[.']" % "|".join(OPTIONAL))


def _skip_reason(name):
    return f"needs {name} (a test dependency: pip install -e '.[test]')"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    m = _NO_MODULE.search(str(rep.longrepr)) if rep.failed and isinstance(collector, pytest.Module) else None
    if m:
        rep.outcome, rep.longrepr = "skipped", (str(collector.path), 0, f"Skipped: {_skip_reason(m.group(1))}")
    return rep


def _optional_missing(e):
    """The optional package whose absence caused `e` (looked up through the exception's causes: transformers
    re-raises a missing tokenizers as its own error), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        top = (getattr(e, "name", None) or "").split(".")[0] if isinstance(e, ModuleNotFoundError) else ""
        if top in OPTIONAL:
            return top
        e = e.__cause__ or e.__context__
    return None


def _skip_if_optional_missing():
    """Hook body: a missing optional dependency skips the test instead of failing it."""
    try:
        return (yield)
    except Exception as e:
        name = _optional_missing(e)
        if name:
            pytest.skip(_skip_reason(name))
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _skip_if_optional_missing())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _skip_if_optional_missing())
