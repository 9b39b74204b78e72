"""VLLMEngine: needs vLLM and a GPU; skipped with a visible reason otherwise. The full GPU check is
tests/rollout/vllm_gpu_check.py (run it where a GPU is lent)."""
import pytest
import torch

from compactionrl_fast.rollout import VLLMEngine, vllm_available


def test_vllm_engine_is_importable_without_vllm():
    assert VLLMEngine.__name__ == "VLLMEngine"  # the module imports vllm only when an engine is built


_SKIP = ("vllm is not installed (optional dependency: pip install vllm)" if not vllm_available() else
         "VLLMEngine needs a CUDA GPU" if not torch.cuda.is_available() else None)


@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_vllm_gpu_check(tmp_path):
    from .vllm_gpu_check import main

    assert main(["--workdir", str(tmp_path), "--rollouts", "8"]) == 0
