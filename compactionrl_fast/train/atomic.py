"""Atomic file writes: a file is either its old content or its complete new content, never half written.

Every file the trainer and the demo write goes through `atomic_write` (or `atomic_dir` for a directory
such as a Hugging Face model): the data goes to a temporary file in the same directory, is flushed and
fsynced, then `os.replace`d over the target, and the directory is fsynced so the rename survives a crash.
A process killed mid-write leaves only a temporary `.NAME.tmp-PID`; `remove_stale_temps` deletes those
of dead processes at the next start. A full disk raises "no space left on device while writing PATH"
and removes the partial file.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil

TMP_TAG = ".tmp-"  # temporary names: "." + target name + TMP_TAG + writer's pid
_TMP_RE = re.compile(r"^\..+\.tmp-(\d+)$")


def _tmp_name(path: str) -> str:
    d, name = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{name}{TMP_TAG}{os.getpid()}")


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory; the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_no_space(e: BaseException) -> bool:
    """A full disk, as an OSError or as torch's zip writer reports it ("unexpected pos")."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and ("unexpected pos" in msg or "No space left" in msg)


def _remove(p: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)


def _raise_clear(e: BaseException, path: str):
    if is_no_space(e):
        raise OSError(errno.ENOSPC, f"no space left on device while writing {path}") from e
    if isinstance(e, OSError) and e.errno is not None and not isinstance(e, FileNotFoundError):
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from e
    raise e


def atomic_write(path: str, write, *, text: bool = False) -> str:
    """Write `path` atomically: `write(f)` fills a temporary file object (binary, or text when `text`).

    Returns `path`. On any error the temporary file is removed and `path` keeps its old content.
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # 0o666 & ~umask, like open()
        with os.fdopen(fd, "w" if text else "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        _raise_clear(e, path)
    _fsync_dir(d)
    return path


def write_text(path: str, data: str) -> str:
    return atomic_write(path, lambda f: f.write(data), text=True)


def torch_save(obj, path: str) -> str:
    """`torch.save(obj, path)`, atomically."""
    import torch

    return atomic_write(path, lambda f: torch.save(obj, f))


@contextlib.contextmanager
def atomic_dir(path: str):
    """Fill a directory atomically: `with atomic_dir(p) as tmp:` write into `tmp`; on success `tmp` replaces
    `p` (the old `p`, if any, is removed after the swap), on error `tmp` is removed and `p` is untouched."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = _tmp_name(path)
    old = os.path.join(parent, f".{os.path.basename(path)}.old{TMP_TAG}{os.getpid()}")
    _remove(tmp)
    try:
        os.makedirs(tmp)
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        if os.path.exists(old) and not os.path.exists(path):
            os.replace(old, path)
        _raise_clear(e, path)
    _fsync_dir(parent)
    _remove(old)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(directory: str) -> list:
    """Delete the temporary files and directories that writers killed mid-write left in `directory`
    (those whose writer process is gone). Returns the removed paths."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        m = _TMP_RE.match(name)
        if m and not _alive(int(m.group(1))):
            p = os.path.join(directory, name)
            _remove(p)
            removed.append(p)
    return removed
