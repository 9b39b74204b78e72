"""compactionrl_fast.train.atomic beyond tests/train/test_io.py: where the temporary file goes, which errors
count as a full disk, how other write errors are reported, the file mode, and which writers count as alive."""
import errno
import os
import subprocess
import sys

import pytest

from compactionrl_fast.train import atomic


def _raise(error):
    raise error


def test_the_temporary_file_sits_beside_the_target(tmp_path, monkeypatch):
    target, cwd = tmp_path / "target", tmp_path / "cwd"
    target.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a temporary in the working folder could sit on another filesystem
    seen = []
    atomic.atomic_write(target / "f.txt", lambda f: seen.append(sorted(os.listdir(target))) or f.write("x"), text=True)
    assert seen == [[f".f.txt{atomic.TMP_TAG}{os.getpid()}"]]
    assert os.listdir(cwd) == [] and os.listdir(target) == ["f.txt"]


@pytest.mark.parametrize("error,full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1472 vs 1366"), True),
    (RuntimeError("write failed: No space left on device"), True),
    (RuntimeError("boom"), False),
    (OSError(errno.EACCES, "Permission denied"), False),
    (ValueError("No space left on device"), False),  # only torch's RuntimeError is read for the words
])
def test_which_errors_are_a_full_disk(error, full):
    assert atomic.is_no_space(error) is full


def test_other_write_errors_name_the_target_and_keep_their_errno(tmp_path):
    path = tmp_path / "f.txt"
    denied = PermissionError(errno.EACCES, "Permission denied")
    with pytest.raises(OSError) as e:
        atomic.atomic_write(path, lambda f: _raise(denied))
    assert type(e.value) is PermissionError and e.value.errno == errno.EACCES and e.value.__cause__ is denied
    assert str(e.value) == f"[Errno {errno.EACCES}] cannot write {path}: Permission denied"
    # an OSError without an errno, a missing file, any other error: raised as they are
    for error in (OSError("plain"), FileNotFoundError(errno.ENOENT, "gone"), KeyError("k")):
        with pytest.raises(type(error)) as e:
            atomic.atomic_write(path, lambda f, error=error: _raise(error))
        assert e.value is error
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o077])
def test_the_file_mode_is_that_of_open(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic.write_text(tmp_path / "f.txt", "x")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "f.txt").st_mode & 0o777 == 0o666 & ~umask


def test_temporaries_of_live_writers_stay_and_the_writers_are_not_signalled(tmp_path, monkeypatch):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        name = f".checkpoint.pt{atomic.TMP_TAG}{live.pid}"
        (tmp_path / name).write_bytes(b"partial")
        real_kill, sent = os.kill, []
        monkeypatch.setattr(atomic.os, "kill", lambda pid, sig: sent.append((pid, sig)) or real_kill(pid, sig))
        assert atomic.remove_stale_temps(str(tmp_path)) == []
        assert os.listdir(tmp_path) == [name]
        assert sent == [(live.pid, 0)]  # probed with signal 0: nothing is sent to the writer
        assert live.poll() is None
        # a writer of another user: os.kill is refused, the process exists

        def refused(pid, sig):
            if pid == live.pid and sig == 0:
                raise PermissionError(errno.EPERM, "Operation not permitted")
            return real_kill(pid, sig)

        monkeypatch.setattr(atomic.os, "kill", refused)
        assert atomic.remove_stale_temps(str(tmp_path)) == [] and os.listdir(tmp_path) == [name]
    finally:
        live.kill()
        live.wait()
