"""Import stubs for what cannot install on a CPU machine (sglang, sglang_router), as slime's own CPU tests
stub them (tests/plugin_contracts/_shared.py, tests/_cp_dist_helpers.py): modules whose names slime's imports
only bind at import time. Nothing here runs sglang; a test that called into a stub would fail loudly."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("sglang", "sglang_router")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__, "__stub__": True})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def install() -> None:
    """Stub sglang and sglang_router for import (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
