"""The slime integration's tests need slime (the source snapshot: `make test-slime` puts it on PYTHONPATH),
megatron-core and ray; without them every module here skips itself with the reason (`skip_without_slime`)."""
import importlib.util

import pytest


def missing_reason():
    """Why the slime tests cannot run here, or None."""
    for mod, why in (("slime", "slime (make test-slime: the snapshot ../shared/vendor/slime-624b824)"),
                     ("megatron.core", "megatron-core==0.16.1 (make test-slime)"), ("ray", "ray (make test-slime)")):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"needs {why}"
        except ImportError:
            return f"needs {why}"
    try:
        if importlib.util.find_spec("slime.utils.types") is None:  # the index's `slime` is another package
            return "needs slime from THUDM (make test-slime), not the package index's unrelated `slime`"
    except ImportError:
        return "needs slime from THUDM (make test-slime), not the package index's unrelated `slime`"
    return None


def skip_without_slime():
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
