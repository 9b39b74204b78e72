"""The ops' modes, defined once: each mode's name (what the Python API takes) and integer code (what the
kernels read). Imported by the package (compactionrl_fast/ops/*) and the Triton kernels (kernels/*); the
C++/CUDA code reads the same codes from csrc/common/modes.h, which this module writes at build time (setup.py,
CMakeLists.txt and the tests' host builds run it; not committed, so no copy in git can fall behind the table):

    python -m compactionrl_fast.kernels --write-header     (or `python kernels/modes.py --write-header`: no imports)

A Python constant is PREFIX_NAME (CROSS_STITCHED), its C++ constant kPrefixName (crf::kCrossStitched).
"""
from __future__ import annotations

import os
import sys

# cross_segment (segment_gae): how the segments of one rollout interact. "none": each segment its own
# recurrence; "paper": the same, advantages scaled by (gamma*lam)^N_later; "stitched": one recurrence
# across the rollout's segments.
CROSS_NONE, CROSS_PAPER, CROSS_STITCHED = 0, 1, 2
CROSS_SEGMENT = {"none": CROSS_NONE, "paper": CROSS_PAPER, "stitched": CROSS_STITCHED}
# each mode in a few words (the trainer's config help and docs/config.md, in this order), where its final rewards
# go (place_final_rewards' mode; the trainer and packing read it), whether its numbers read the segments'
# trainable-token counts (`needs_counts`)
CROSS_SEGMENT_HELP = {"paper": "each segment's GAE scaled by (gamma*lam)^N, N = trainable tokens in later segments",
                      "none": "unscaled (ablation)", "stitched": "one exact GAE over the rollout's segments"}
CROSS_REWARDS = {"none": "paper", "paper": "paper", "stitched": "stitched"}
CROSS_COUNTED = (CROSS_PAPER,)

# lambda (segment_gae): how each segment's lambda is chosen. A float; 1 - 1/(alpha * n) with n the trainable
# tokens of the segment or of its rollout (lam="adaptive", adaptive_length); a per-segment tensor.
LAM_CONST, LAM_ADAPTIVE_SEGMENT, LAM_ADAPTIVE_ROLLOUT, LAM_TENSOR = 0, 1, 2, 3
LAMBDA = {"const": LAM_CONST, "adaptive-segment": LAM_ADAPTIVE_SEGMENT, "adaptive-rollout": LAM_ADAPTIVE_ROLLOUT,
          "tensor": LAM_TENSOR}
LAM_COUNTED = (LAM_ADAPTIVE_SEGMENT, LAM_ADAPTIVE_ROLLOUT)

# reduction (the losses, segment_weights): the weight of a token, see compactionrl_fast/ops/_reduction.py.
REDUCTION_TOKEN_MEAN, REDUCTION_SEGMENT_MEAN, REDUCTION_ROLLOUT_MEAN, REDUCTION_SUM = 0, 1, 2, 3
REDUCTION = {"token-mean": REDUCTION_TOKEN_MEAN, "segment-mean": REDUCTION_SEGMENT_MEAN,
             "rollout-mean": REDUCTION_ROLLOUT_MEAN, "sum": REDUCTION_SUM}
REDUCTION_HELP = {"token-mean": "over all trainable tokens of the global batch (the paper)",
                  "segment-mean": "mean of per-segment means (ablation: w/o token-level loss)"}

# reward placement (place_final_rewards): "paper": a rollout's reward on the last trainable token of each of
# its segments; "stitched": on the rollout's last trainable token only.
REWARD_PAPER, REWARD_STITCHED = 0, 1
REWARD_PLACEMENT = {"paper": REWARD_PAPER, "stitched": REWARD_STITCHED}

# group -> (its names and codes, the constants' prefix, the C++ enum)
TABLE = {
    "cross_segment": (CROSS_SEGMENT, "CROSS", "CrossMode"),
    "lambda": (LAMBDA, "LAM", "LamMode"),
    "reduction": (REDUCTION, "REDUCTION", "Reduction"),
    "reward_placement": (REWARD_PLACEMENT, "REWARD", "RewardPlacement"),
}

HEADER = os.path.join("csrc", "common", "modes.h")  # relative to the repository root; generated, git-ignored
WRITE_HEADER = "python -m compactionrl_fast.kernels --write-header"  # the command that writes it (kernels/__main__.py)
# kernels/ sits in the repository root (the package reaches it through a symlink or package_dir)
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def needs_counts(lam_mode: int, cross: int) -> bool:
    """Whether a segment_gae's per-segment numbers read the segments' trainable-token counts (the Triton params
    kernel; C++: CRF_NEEDS_COUNTS in csrc/common/modes.h)."""
    return cross in CROSS_COUNTED or lam_mode in LAM_COUNTED


def help_text(names, what: str, described: dict) -> str:
    """A config key's help: "a | b | c: what. a: ...; b: ..." (names in `described`'s order first)."""
    order = list(described) + [n for n in names if n not in described]
    return f"{' | '.join(order)}: {what}. " + "; ".join(f"{n}: {d}" for n, d in described.items())


def constant_name(prefix: str, name: str) -> str:
    """The Python constant of a mode: ("CROSS", "stitched") -> "CROSS_STITCHED"."""
    return f"{prefix}_{name.upper().replace('-', '_')}"


def cpp_name(prefix: str, name: str) -> str:
    """The C++ constant of a mode: ("LAM", "adaptive-rollout") -> "kLamAdaptiveRollout"."""
    return "k" + "".join(w.capitalize() for w in constant_name(prefix, name).split("_"))


def header() -> str:
    """The text of csrc/common/modes.h."""
    lines = ["// Generated from kernels/modes.py at build time (setup.py, CMakeLists.txt, the tests' host builds);",
             "// not committed: edit the table there. The ops' mode codes for the C++/CUDA kernels.",
             "#pragma once", "#include <cstdint>", "", "namespace crf {", ""]
    for group, (modes, prefix, enum) in TABLE.items():
        items = [f"{cpp_name(prefix, n)} = {c}" for n, c in modes.items()]
        one_line = f"enum {enum} : int64_t {{ {', '.join(items)} }};"
        lines += [f"// {group}"] + ([one_line] if len(one_line) <= 110 else
                                    [f"enum {enum} : int64_t {{"] + [f"  {x}," for x in items] + ["};"]) + [""]
    counted = [f"(cross) == crf::{cpp_name('CROSS', n)}" for n, c in CROSS_SEGMENT.items() if c in CROSS_COUNTED]
    counted += [f"(lam_mode) == crf::{cpp_name('LAM', n)}" for n, c in LAMBDA.items() if c in LAM_COUNTED]
    lines += ["}  // namespace crf", "",
              "// Every mode of a group, e.g. for a loop: for (int64_t c : CRF_CROSS_MODES)."]
    for modes, prefix, _ in TABLE.values():
        items = "{" + ", ".join(f"crf::{cpp_name(prefix, n)}" for n in modes) + "}"
        one_line = f"#define CRF_{prefix}_MODES {items}"
        lines += [one_line] if len(one_line) <= 110 else [f"#define CRF_{prefix}_MODES \\", f"  {items}"]
    lines += ["",
              "// Whether segment_gae's per-segment numbers read the segments' trainable-token counts.",
              "#define CRF_NEEDS_COUNTS(lam_mode, cross) \\", f"  ({' || '.join(counted)})", "",
              "// Every mode as X(group, name, constant), e.g. to expose them to Python (csrc/module.cpp).",
              "#define CRF_MODES(X) \\"]
    rows = [f'  X("{group}", "{n}", crf::{cpp_name(prefix, n)})'
            for group, (modes, prefix, _) in TABLE.items() for n in modes]
    lines += [r + " \\" for r in rows[:-1]] + [rows[-1], ""]
    return "\n".join(lines)


def write_header(root: str = ROOT) -> bool:
    """Write <root>/csrc/common/modes.h from the table; True if it changed. An unchanged header is left alone
    (its time too), so that a build recompiles only after an edit of the table."""
    path = os.path.join(root, HEADER)
    text = header()
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"  # renamed into place: a parallel build never reads half a header
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


def main(argv):
    if argv != ["--write-header"]:
        sys.exit(f"usage: {WRITE_HEADER}")
    changed = write_header()
    print(f"{'wrote' if changed else 'up to date:'} {os.path.join(ROOT, HEADER)}")


if __name__ == "__main__":
    main(sys.argv[1:])
