"""Build of compactionrl-fast. Needs torch installed first: `pip install --no-build-isolation -e .`

The extension `compactionrl_fast._C` always holds the C++ CPU kernels (csrc/cpu). The CUDA kernels
(csrc/cuda) join it when torch is a CUDA build and nvcc is found, or when COMPACTIONRL_FAST_BUILD_CUDA=1
forces it (=0 turns them off). Architectures come from TORCH_CUDA_ARCH_LIST (default "8.0;9.0").
Every environment variable is listed in the README's "Environment variables" section.
"""
import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

here = os.path.dirname(os.path.abspath(__file__))


def want_cuda():
    flag = os.environ.get("COMPACTIONRL_FAST_BUILD_CUDA", "auto").lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        return True
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def extension():
    rel = lambda pattern: sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, pattern)))
    sources = ["csrc/module.cpp"] + rel("csrc/cpu/*.cpp")
    cxx = ["-O3", "-std=c++17", "-fopenmp"]
    kwargs = dict(extra_link_args=["-fopenmp"])
    if want_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        return cpp_extension.CUDAExtension(
            "compactionrl_fast._C", sources + rel("csrc/cuda/*.cu"),
            extra_compile_args={"cxx": cxx + ["-DCRF_WITH_CUDA"], "nvcc": ["-O3", "-DCRF_WITH_CUDA"]}, **kwargs)
    return cpp_extension.CppExtension("compactionrl_fast._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    packages=["compactionrl_fast", "compactionrl_fast.kernels"]
    + [f"compactionrl_fast.{p}" for p in ("ops", "reference", "rollout", "rollout.engines", "envs", "train",
                                          "integrations") if os.path.isdir(os.path.join(here, "compactionrl_fast", *p.split(".")))],
    package_dir={"compactionrl_fast": "compactionrl_fast", "compactionrl_fast.kernels": "kernels"},
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
