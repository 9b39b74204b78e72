"""The suite's skip rule: a missing optional test dependency (tokenizers, transformers) skips, also when a
library re-raises it as its own error; any other error still fails."""
from tests.conftest import _optional_missing


def _wrapped(name):
    try:
        try:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        except ModuleNotFoundError as e:
            raise RuntimeError("could not import the tokenizer backend") from e
    except RuntimeError as e:
        return e


def test_missing_optional_dependency_is_found_through_the_causes():
    assert _optional_missing(ModuleNotFoundError("x", name="tokenizers.models")) == "tokenizers"
    assert _optional_missing(_wrapped("transformers")) == "transformers"


def test_other_errors_are_not_skipped():
    assert _optional_missing(_wrapped("numpy")) is None
    assert _optional_missing(RuntimeError("boom")) is None
    assert _optional_missing(ModuleNotFoundError("x", name=None)) is None
