"""The framework integrations' registry: each integration package (compactionrl_fast/integrations/<name>/)
declares one `IntegrationSpec` in its `__init__.py` (`SPEC = declare(IntegrationSpec(...))`), and
tests/integrations/test_checklist.py fails, naming what to write, while one of its pieces is missing
(docs/adding-an-integration.md): the docs page and its "What ran here", piece tests against the float64 reference
through the framework's real code, a whole-job test in CI, bad-input tests on every rank, the recipe's metrics in
the framework's logger.
"""
from __future__ import annotations

import dataclasses

# the framework-agnostic adapters beside the integration packages: op adapters, not integrations
NOT_INTEGRATIONS = ("openrlhf", "trl", "padded")


@dataclasses.dataclass(frozen=True)
class IntegrationSpec:
    """One framework integration. Paths are relative to the repository root; tests are "file::function".

    name: the folder of its package (compactionrl_fast/integrations/<name>/) and of its tests
        (tests/integrations/<name>/), and its docs page (docs/<name>.md).
    framework: the framework's import name (what its tests import or importorskip).
    reference_tests: tests that run the plug-in through the framework's real code and compare its numbers with
        the float64 reference (compactionrl_fast.reference).
    job_test: the whole-job test: the job users launch, through the framework's own entry point.
    make_target: the Makefile target that runs `job_test` (and a stage of .ci/run).
    bad_input_tests: tests that bad input stops every rank (data parallel >= 2) with a clear error, not a hang.
    metrics: "module:function" that hands the recipe's metrics (docs/metrics.md) to the framework's logger.
    metrics_tests: tests that the logger gets exactly the vocabulary's names.
    """
    name: str
    framework: str
    reference_tests: tuple = ()
    job_test: str = ""
    make_target: str = ""
    bad_input_tests: tuple = ()
    metrics: str = ""
    metrics_tests: tuple = ()


SPECS: dict[str, IntegrationSpec] = {}


def declare(spec: IntegrationSpec) -> IntegrationSpec:
    """Add `spec` to SPECS (declared once, in the integration package's __init__.py)."""
    if SPECS.get(spec.name, spec) != spec:
        raise ValueError(f"integration {spec.name!r} is declared twice")
    SPECS[spec.name] = spec
    return spec
