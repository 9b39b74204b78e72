"""Import stubs for what cannot install on a CPU machine (sglang, sglang_router), as slime's own CPU tests
stub them (tests/plugin_contracts/_shared.py, tests/_cp_dist_helpers.py): modules whose names slime's imports
only bind at import time. Nothing here runs sglang; a test that called into a stub would fail loudly.

`install_job()` is what slime's train.py needs to start (the job, test_job.py, where the real sglang_router is
installed): sglang, Megatron-LM's `megatron.training` (not on the package index) and `torch_memory_saver` (a
CUDA allocator hook) for import, and stand-ins that are called: Megatron-LM's argument parser (the flags slime
reads on the rollout side), SGLang's ServerArgs (the fields slime reads and adds as CLI flags), and a backend
of slime's accelerator registry for Ray's logical GPUs."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.abc
import importlib.machinery
import os
import sys
import tempfile
import types

STUBBED = ("sglang", "sglang_router")
JOB_STUBBED = ("sglang", "megatron.training", "torch_memory_saver")  # sglang_router: the real one


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__, "__stub__": True})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names=STUBBED):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
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


@dataclasses.dataclass
class ServerArgs:
    """SGLang's ServerArgs as slime reads it: the address and the parallel sizes (slime adds the fields as
    --sglang-<field> flags, and keeps these keys of what it computes for an engine)."""

    host: str = "127.0.0.1"
    port: int = 30000
    node_rank: int = 0
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    moe_dp_size: int = 1
    enable_dp_attention: bool = False

    @staticmethod
    def add_cli_args(parser):
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                parser.add_argument(flag, action="store_true")
            else:
                parser.add_argument(flag, type=type(f.default), default=f.default)


# Megatron-LM's flags that slime reads on the rollout side, (type, Megatron-LM's default); bool: a switch.
MEGATRON_FLAGS = dict(seed=(int, 1234), micro_batch_size=(int, 1), global_batch_size=(int, None),
                      tensor_model_parallel_size=(int, 1), pipeline_model_parallel_size=(int, 1),
                      context_parallel_size=(int, 1), load=(str, None), save=(str, None), save_interval=(int, None),
                      seq_length=(int, None), max_position_embeddings=(int, None), vocab_size=(int, None),
                      padded_vocab_size=(int, None), tokenizer_model=(str, None), tokenizer_type=(str, None),
                      distributed_backend=(str, "nccl"), distributed_timeout_minutes=(int, 10), lr=(float, None),
                      no_load_optim=bool, no_load_rng=bool, finetune=bool, fp16=bool, bf16=bool,
                      multi_latent_attention=bool, calculate_per_token_loss=bool,
                      use_checkpoint_opt_param_scheduler=bool)


def megatron_parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """Megatron-LM's parse_args: its flags, then slime's (extra_args_provider), from sys.argv."""
    parser = argparse.ArgumentParser(description="Megatron-LM arguments (stand-in)", allow_abbrev=False)
    for name, spec in MEGATRON_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if spec is bool:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=spec[0], default=spec[1])
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args, unknown = parser.parse_known_args()
    if unknown and not ignore_unknown_args:
        raise ValueError(f"unknown arguments: {unknown}")
    return args


def install_job() -> None:
    """What slime's train.py needs to start on CPU (idempotent; also run in Ray's workers)."""
    if not any(isinstance(f, _Finder) and f.names == JOB_STUBBED for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(JOB_STUBBED))
    import megatron.training.arguments as margs
    import torch_memory_saver

    # slime sets --offload-train whenever the critic is on (ppo), --debug-rollout-only included, and then looks
    # for torch_memory_saver's CUDA hook library beside the package to LD_PRELOAD into its Megatron actors: an
    # empty file there (the dynamic loader says it cannot preload it and goes on)
    here = os.path.join(tempfile.gettempdir(), "crf-slime-job-tms")
    os.makedirs(os.path.join(here, "torch_memory_saver"), exist_ok=True)
    open(os.path.join(here, "torch_memory_saver_hook_mode_preload.abi3.so"), "a").close()
    torch_memory_saver.__file__ = os.path.join(here, "torch_memory_saver", "__init__.py")
    import sglang.srt.server_args as sargs

    sargs.ServerArgs = ServerArgs
    margs.parse_args, margs.validate_args = megatron_parse_args, lambda args, *a, **k: args
    _register_label_accelerator()


def _register_label_accelerator():
    """slime's Ray actors ask its accelerator registry which local device their Ray GPU is; on CPU none is
    registered. A backend for Ray's logical GPUs (slime's register_accelerator, its extension point): it maps
    the id (the base class's resolve_visible_device_id) and fails on any device operation."""
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    def unsupported(self, *args, **kwargs):
        raise NotImplementedError("the job's accelerator stand-in labels Ray's logical GPUs; it has no device")

    cls = type("RayLabelAccelerator", (Accelerator,),
               {**{name: unsupported for name in Accelerator.__abstractmethods__},
                "name": "ray-label", "device_type": "cpu", "communication_backend_name": "gloo",
                "is_available": lambda self: True})
    accelerator.register_accelerator("ray-label", cls, lambda: True, priority=-1, communication_backends=("gloo",))
