"""`output_cache`: the C++ CPU ops' cache of output blocks (csrc/common/alloc.h)."""
from . import _dispatch


def output_cache(limit_bytes: int | None = None, clear: bool = False) -> dict:
    """The C++ CPU ops' output cache: their outputs of 1 MiB and more take blocks that freed outputs of the
    same size class gave back (page-touched already), instead of fresh memory from glibc, whose page faults
    can make a call several times slower depending on what the process did before. Freed blocks stay
    cached up to `limit_bytes` (default 256 MiB; 0 turns caching off and frees the cache); `clear` frees
    every cached block. Returns {"cached_bytes", "limit_bytes", "hits", "misses"}."""
    ext = _dispatch.cpp_ext()
    if ext is None:
        raise RuntimeError("output_cache: the C++ extension compactionrl_fast._C is not built")
    if limit_bytes is not None and (not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool)
                                    or limit_bytes < 0):
        raise ValueError(f"output_cache: limit_bytes must be an int >= 0 or None, got {limit_bytes!r}")
    cached, limit, hits, misses = ext.output_cache(-1 if limit_bytes is None else limit_bytes, bool(clear))
    return {"cached_bytes": cached, "limit_bytes": limit, "hits": hits, "misses": misses}
