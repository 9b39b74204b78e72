"""The git revision results files record (benchmarks, the demo)."""
from __future__ import annotations

import subprocess


def git_revision(path: str) -> str | None:
    """Short commit of the checkout holding `path`, "+dirty" with tracked local changes; None without git."""
    try:
        rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "") if rev else None
