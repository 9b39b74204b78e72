"""The checks of config fields: each takes a value and returns None, or why the value is bad (the rest of
"NAME=VALUE: must be ..."); `ConfigError` lists every bad field of a config at once."""
from __future__ import annotations

import math
import re


class ConfigError(ValueError):
    """An invalid config; `problems` lists one line per bad field."""

    def __init__(self, problems: list):
        self.problems = list(problems)
        super().__init__("invalid config (" + str(len(self.problems)) + " bad field"
                         + ("s" if len(self.problems) != 1 else "") + "):\n  " + "\n  ".join(self.problems))


def raise_problems(found: list) -> None:
    if found:
        raise ConfigError(found)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(lo):
    return lambda v: None if is_int(v) and v >= lo else f"must be an integer >= {lo}"


def number(lo=None, hi=None, *, open_lo=False):
    """A finite number in [lo, hi] ((lo, hi] with open_lo)."""
    def check(v):
        if is_num(v) and (lo is None or (v > lo if open_lo else v >= lo)) and (hi is None or v <= hi):
            return None
        lo_s = "-inf" if lo is None else lo
        return f"must be a finite number in {'(' if open_lo else '['}{lo_s}, {'inf)' if hi is None else str(hi) + ']'}"
    return check


def optional(check, what="None"):
    return lambda v: None if v is None else (None if check(v) is None else f"must be {what} or {check(v)[8:]}")


def choice(*choices):
    def check(v):
        return None if isinstance(v, str) and v in choices else f"must be one of {list(choices)}"
    check.choices = choices  # the CLI's placeholder
    return check


def boolean(v):
    return None if isinstance(v, bool) else "must be true or false"


def text(v):
    return None if isinstance(v, str) and v else "must be a non-empty string"


def betas(v):
    ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(is_num(b) and 0 <= b < 1 for b in v)
    return None if ok else "must be two numbers in [0, 1), e.g. [0.9, 0.999]"


def lam_value(v):
    return None if v == "adaptive" or (is_num(v) and 0 <= v <= 1) else "must be 'adaptive' or a number in [0, 1]"


def threads(v):
    return None if v == "auto" or (is_int(v) and v >= 0) else "must be 'auto' or an integer >= 0"


def is_plain(v):
    """Data a checkpoint can hold (it stores the config): str, numbers, bools, None, lists and mappings."""
    if isinstance(v, dict):
        return all(isinstance(k, str) and is_plain(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return all(is_plain(x) for x in v)
    return v is None or type(v) in (str, int, float, bool)


def mapping(v):
    if not (isinstance(v, dict) and all(isinstance(k, str) for k in v)):
        return "must be a mapping of names"
    return None if is_plain(v) else "values must be plain data (str, numbers, booleans, None, lists, mappings)"


def server_urls(v) -> list:
    """server.urls as a list: a list, or one string of URLs separated by commas or spaces."""
    if isinstance(v, str):
        return [u for u in re.split(r"[,\s]+", v) if u]
    return list(v) if isinstance(v, (list, tuple)) else v


def urls(v):
    found = server_urls(v)
    if not isinstance(found, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                              for u in found):
        return "must be a list of http(s) URLs (or one string of them separated by commas)"
    return None


def cpu_binds(v):
    ok = isinstance(v, (list, tuple)) and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)
    return None if ok else "must be a list of CPU lists, one per local replica (e.g. ['0', '1'])"


def dtype(v):
    if v == "float16":
        return ("float16 is not supported: its range overflows in the sampler's softmax and gives NaN "
                "probabilities; use bfloat16 (same memory) or float32")
    return choice("float32", "bfloat16")(v)
