"""Build of compactionrl-fast. Needs torch installed first: `pip install --no-build-isolation -e .`

The extension `compactionrl_fast._C` always holds the C++ CPU kernels (csrc/cpu). The CUDA kernels
(csrc/cuda) join it when torch is a CUDA build and a CUDA toolkit (nvcc and libcudart) is found, or when
COMPACTIONRL_FAST_BUILD_CUDA=1 forces it (then a missing toolkit is an error; =0 turns CUDA off).
The toolkit is looked for in CUDA_HOME / CUDA_PATH, then at the real location of the `nvcc` on PATH
(followed through symlinks and wrapper scripts), then in the usual install folders (/usr/local/cuda...).
Architectures come from TORCH_CUDA_ARCH_LIST (default "8.0;9.0"). The C++ standard is torch's own
(torch.utils.cpp_extension adds it: C++20 for torch >= 2.13 headers, C++17 before).
Every environment variable is listed in docs/development.md ("Environment variables").
"""
import glob
import importlib.util
import os
import re
import shutil
import sys

from setuptools import setup
from torch.utils import cpp_extension

here = os.path.dirname(os.path.abspath(__file__))


def say(msg):
    # stderr: pip shows it with -v, `setup.py build_ext` always.
    print(f"compactionrl-fast setup: {msg}", file=sys.stderr, flush=True)


def _real_nvcc(path, hops=5):
    """The nvcc binary behind `path`: symlinks resolved, and `exec /x/bin/nvcc "$@"`-style wrapper scripts
    followed (a wrapper outside the toolkit would otherwise make its own parent folder look like CUDA_HOME)."""
    for _ in range(hops):
        path = os.path.realpath(path)
        try:
            with open(path, "rb") as f:
                head = f.read(4096)
        except OSError:
            return None
        if head.startswith(b"\x7fELF") or not head.startswith(b"#!"):
            return path
        targets = [t for t in re.findall(rb"(/[^\s\"'`;|&]+/bin/nvcc)\b", head)
                   if os.path.realpath(t.decode()) != path and os.path.exists(t.decode())]
        if not targets:
            return path  # a script we cannot see through: take its own folder
        path = targets[0].decode()
    return path


def _cudart(home):
    """libcudart files in the toolkit `home` (the linker needs them for -lcudart)."""
    pats = ("lib64/libcudart.so*", "lib/libcudart.so*", "targets/*/lib/libcudart.so*", "lib/x64/cudart.lib")
    return sorted(p for pat in pats for p in glob.glob(os.path.join(home, pat)))


def find_cuda_home():
    """(toolkit folder or None, list of what was tried and why it was rejected)."""
    tried, candidates = [], []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append((f"${var}", os.environ[var]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = _real_nvcc(nvcc)
        if real:
            candidates.append((f"nvcc on PATH ({nvcc} -> {real})", os.path.dirname(os.path.dirname(real))))
    usual = ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True) + ["/opt/cuda", "/usr/lib/cuda"]
    candidates += [("usual folder", p) for p in usual if os.path.isdir(p)]
    for how, home in candidates:
        home = os.path.realpath(home)
        if not os.path.exists(os.path.join(home, "bin", "nvcc")):
            tried.append(f"{how}: {home} has no bin/nvcc")
        elif not _cudart(home):
            tried.append(f"{how}: {home} has no libcudart")
        else:
            return home, tried + [f"{how}: {home}"]
    return None, tried or ["no CUDA_HOME/CUDA_PATH, no nvcc on PATH, no /usr/local/cuda*"]


def want_cuda():
    """True to build the CUDA kernels; sets torch's CUDA_HOME to the toolkit found. Says why either way."""
    import torch

    flag = os.environ.get("COMPACTIONRL_FAST_BUILD_CUDA", "auto").strip().lower() or "auto"
    if flag in ("0", "false", "no", "off"):
        say("COMPACTIONRL_FAST_BUILD_CUDA=0: building the CPU kernels only")
        return False
    forced = flag in ("1", "true", "yes", "on")
    if not forced and flag != "auto":
        raise SystemExit(f"compactionrl-fast setup: COMPACTIONRL_FAST_BUILD_CUDA must be 0, 1 or auto, got {flag!r}")
    if torch.version.cuda is None:
        msg = f"torch {torch.__version__} is not a CUDA build"
        if forced:
            raise SystemExit(f"compactionrl-fast setup: COMPACTIONRL_FAST_BUILD_CUDA=1 but {msg}; install a CUDA torch wheel")
        say(f"{msg}: building the CPU kernels only")
        return False
    home, tried = find_cuda_home()
    if home is None:
        msg = "no CUDA toolkit found (" + "; ".join(tried) + ")"
        if forced:
            raise SystemExit(f"compactionrl-fast setup: COMPACTIONRL_FAST_BUILD_CUDA=1 but {msg}; set CUDA_HOME to the toolkit folder")
        say(f"{msg}: building the CPU kernels only")
        return False
    # torch guessed its own CUDA_HOME at import (the parent of whatever `nvcc` is on PATH): use ours.
    os.environ["CUDA_HOME"] = home
    cpp_extension.CUDA_HOME = home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    for t in tried[:-1]:
        say(f"skipped {t}")
    say(f"building the CUDA kernels with the toolkit {home} (from {tried[-1].rsplit(':', 1)[0]}; "
        f"{os.path.basename(_cudart(home)[0])}), torch CUDA {torch.version.cuda}, "
        f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    return True


def write_modes_header():
    """csrc/common/modes.h, the mode codes the kernels read, from the one table kernels/modes.py (generated here,
    not committed). modes.py is loaded by path: it imports nothing of the package."""
    spec = importlib.util.spec_from_file_location("_crf_modes", os.path.join(here, "kernels", "modes.py"))
    modes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modes)
    if modes.write_header(here):
        say(f"wrote {modes.HEADER} from kernels/modes.py")


def extension():
    rel = lambda pattern: sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, pattern)))
    sources = ["csrc/module.cpp", "csrc/schemas.cpp"] + rel("csrc/cpu/*.cpp")  # schemas.cpp: every op's schema
    # No -std here: torch.utils.cpp_extension adds the standard its headers need (and nvcc accepts one only).
    cxx = ["-O3", "-fopenmp"]
    kwargs = dict(extra_link_args=["-fopenmp"])
    if want_cuda():
        return cpp_extension.CUDAExtension(
            "compactionrl_fast._C", sources + rel("csrc/cuda/*.cu"),
            extra_compile_args={"cxx": cxx + ["-DCRF_WITH_CUDA"], "nvcc": ["-O3", "-DCRF_WITH_CUDA"]}, **kwargs)
    return cpp_extension.CppExtension("compactionrl_fast._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)


write_modes_header()
setup(
    packages=["compactionrl_fast", "compactionrl_fast.kernels"]
    + [f"compactionrl_fast.{p}" for p in ("ops", "reference", "rollout", "rollout.engines", "envs", "train",
                                          "integrations", "integrations.slime", "app") if os.path.isdir(os.path.join(here, "compactionrl_fast", *p.split(".")))],
    package_dir={"compactionrl_fast": "compactionrl_fast", "compactionrl_fast.kernels": "kernels"},
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
