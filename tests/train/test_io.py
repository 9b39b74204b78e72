"""Atomic writes, a full disk, stale temporary files, and safe checksummed checkpoints."""
import errno
import os
import random
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from compactionrl_fast.train import atomic, checkpoint
from compactionrl_fast.train.checkpoint import CorruptCheckpointError

from ._tiny import tiny_models


def _files(d):
    return sorted(os.listdir(d))


def _save_tiny(run_dir, step=3, extra=None):
    actor, critic = tiny_models()
    opt = torch.optim.Adam(actor.parameters(), lr=1e-3)
    actor(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()  # non-empty optimiser state
    path = checkpoint.save(str(run_dir), models={"actor": actor, "critic": critic}, optimizers={"actor": opt},
                           step=step, extra=extra)
    return path, actor, critic, opt


def test_atomic_write_keeps_the_old_file_on_error(tmp_path):
    p = tmp_path / "f.txt"
    atomic.write_text(p, "old")

    def boom(f):
        f.write("half of the new")
        raise KeyError("writer failed")

    with pytest.raises(KeyError):
        atomic.atomic_write(p, boom, text=True)
    assert p.read_text() == "old" and _files(tmp_path) == ["f.txt"]
    atomic.write_text(p, "new")
    assert p.read_text() == "new" and _files(tmp_path) == ["f.txt"]


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1472 vs 1366"),
    OSError(errno.ENOSPC, "No space left on device")])
def test_full_disk_is_a_clear_error_and_leaves_no_partial_file(tmp_path, monkeypatch, error):
    path, *_ = _save_tiny(tmp_path, step=1)
    good = open(path, "rb").read()
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        real_save(obj, f, *a, **k)  # some bytes reach the temporary file, then the disk is full
        raise error

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=f"no space left on device while writing {path}") as e:
        _save_tiny(tmp_path, step=2)
    assert e.value.errno == errno.ENOSPC
    assert _files(tmp_path) == ["checkpoint.pt"] and open(path, "rb").read() == good  # old checkpoint intact
    monkeypatch.undo()
    with pytest.raises(OSError, match="no space left on device while writing .*config.json"):
        atomic.atomic_write(tmp_path / "config.json", lambda f: (f.write("{"), _raise(error)), text=True)
    assert _files(tmp_path) == ["checkpoint.pt"]


def _raise(e):
    raise e


def test_read_only_directory_names_the_target(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(OSError, match=f"cannot write {d / 'config.json'}"):
            atomic.write_text(d / "config.json", "{}")
    finally:
        d.chmod(0o700)


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [f".checkpoint.pt.tmp-{dead.pid}", f".actor.tmp-{dead.pid}", f".actor.old.tmp-{dead.pid}"]
    for name in stale:
        (tmp_path / name).mkdir() if "actor" in name else (tmp_path / name).write_bytes(b"partial")
    live = f".metrics.jsonl.tmp-{os.getpid()}"  # a writer that is still running: left alone
    (tmp_path / live).write_text("x")
    (tmp_path / "checkpoint.pt").write_bytes(b"keep")
    removed = atomic.remove_stale_temps(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(stale)
    assert _files(tmp_path) == sorted([live, "checkpoint.pt"])


def test_atomic_dir_swaps_whole_directories(tmp_path):
    d = tmp_path / "actor"
    with atomic.atomic_dir(d) as t:
        open(os.path.join(t, "a"), "w").write("1")
    with pytest.raises(ValueError):
        with atomic.atomic_dir(d) as t:
            open(os.path.join(t, "a"), "w").write("2")
            raise ValueError("save_pretrained failed")
    assert _files(d) == ["a"] and (d / "a").read_text() == "1" and _files(tmp_path) == ["actor"]
    with atomic.atomic_dir(d) as t:
        open(os.path.join(t, "b"), "w").write("3")
    assert _files(d) == ["b"] and _files(tmp_path) == ["actor"]


def test_checkpoint_round_trip_restores_everything_bitwise(tmp_path):
    path, actor, critic, opt = _save_tiny(tmp_path, step=7, extra={"note": "x", "hist": [1, 2.5, None],
                                                                    "t": torch.arange(3), "np": np.float64(0.5),
                                                                    "flag": np.bool_(True), "n": np.int64(3)})
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    draws = (torch.rand(4), random.random(), np.random.rand(3))
    a2, c2 = tiny_models(seed=1)
    o2 = torch.optim.Adam(a2.parameters(), lr=1e-3)
    info = checkpoint.load(str(tmp_path), models={"actor": a2, "critic": c2}, optimizers={"actor": o2})
    assert info["step"] == 7 and info["extra"]["note"] == "x" and info["extra"]["hist"] == [1, 2.5, None]
    assert (info["extra"]["np"], info["extra"]["flag"], info["extra"]["n"]) == (0.5, True, 3)
    for m1, m2 in ((actor, a2), (critic, c2)):
        s1, s2 = m1.state_dict(), m2.state_dict()
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    s1, s2 = opt.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])
    # the RNG streams are those at save time, whatever was drawn since
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    checkpoint.load(str(tmp_path), models={}, optimizers={})
    after = (torch.rand(4), random.random(), np.random.rand(3))
    checkpoint.load(str(tmp_path), models={}, optimizers={})
    again = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(after[0], again[0]) and after[1] == again[1] and np.array_equal(after[2], again[2])
    assert not torch.equal(after[0], draws[0])


def test_non_plain_extra_is_refused_at_save(tmp_path):
    with pytest.raises(TypeError, match=r"extra.*\['obj'\].*not plain data"):
        _save_tiny(tmp_path, extra={"obj": object()})
    assert _files(tmp_path) == []


class _Evil:
    def __reduce__(self):
        return (os.mkdir, ("/tmp/compactionrl_fast_pwned_by_checkpoint",))


def test_a_crafted_checkpoint_does_not_run_code(tmp_path):
    marker = "/tmp/compactionrl_fast_pwned_by_checkpoint"
    if os.path.exists(marker):
        os.rmdir(marker)
    torch.save({"format": checkpoint.FORMAT, "data": {"x": _Evil()}, "sha256": ""}, tmp_path / "checkpoint.pt")
    with pytest.raises(CorruptCheckpointError, match=str(tmp_path / "checkpoint.pt")):
        checkpoint.load(str(tmp_path), models={}, optimizers={})
    assert not os.path.exists(marker)


def _tensor_record(path):
    """(offset, size) of the largest tensor record's bytes in the (uncompressed) zip file."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + n + m, info.file_size


def test_flipped_bytes_fail_the_checksum(tmp_path):
    path, *_ = _save_tiny(tmp_path)
    off, size = _tensor_record(path)
    data = bytearray(open(path, "rb").read())
    for i in range(off + size // 2, off + size // 2 + 64):
        data[i] ^= 0x5A
    open(path, "wb").write(bytes(data))
    a2, c2 = tiny_models()
    with pytest.raises(CorruptCheckpointError, match=f"{path}.*checksum"):
        checkpoint.load(str(tmp_path), models={"actor": a2, "critic": c2}, optimizers={})


@pytest.mark.parametrize("keep", [0, 100, 0.5])
def test_empty_or_truncated_files_name_the_file(tmp_path, keep):
    path, *_ = _save_tiny(tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        checkpoint.load(str(tmp_path), models={}, optimizers={})
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        checkpoint.load_state_dict(path)


def test_old_unchecked_checkpoints_are_refused(tmp_path):
    torch.save({"step": 1, "models": {}, "optimizers": {}}, tmp_path / "checkpoint.pt")
    with pytest.raises(CorruptCheckpointError, match="no checksum"):
        checkpoint.load(str(tmp_path), models={}, optimizers={})


def test_metrics_log_full_disk_and_a_cut_line(tmp_path, monkeypatch):
    from compactionrl_fast.train.log import MetricsLog, read_rows

    log = MetricsLog(str(tmp_path), tensorboard=False)
    log.log(0, {"reward": 1.0})
    path = tmp_path / "metrics.jsonl"
    good = path.read_text()
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=f"no space left on device while writing {path}"):
        log.log(1, {"reward": 2.0})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_text() == good  # the partial line is gone
    # a line cut by a kill: dropped when the run resumes
    with open(path, "a") as f:
        f.write('{"step": 1, "rew')
    MetricsLog(str(tmp_path), resume_step=5, tensorboard=False)
    assert [r["step"] for r in read_rows(path)] == [0] and path.read_text() == good


def test_bad_plain_data_is_named_by_its_path(tmp_path):
    class Gadget:
        pass

    with pytest.raises(TypeError, match=r"checkpoint payload\['extra'\]\['a'\]\[1\]: Gadget is not plain data"):
        _save_tiny(tmp_path, extra={"a": [1, Gadget()]})
    with pytest.raises(TypeError, match=r"checkpoint payload\['extra'\]: key \(1, 2\) is not plain data"):
        _save_tiny(tmp_path, extra={(1, 2): 0})
    assert _files(tmp_path) == []


def test_checksum_covers_values_and_their_types():
    values = [[1], (1,), [1.0], ["1"], [True], [None], {"a": 1}, {"a": 2}, {1: 1}, [torch.zeros(0)],
              [torch.zeros(0, dtype=torch.int64)], [torch.zeros(1)], [[1, 2]], [[1], [2]]]
    sums = [checkpoint.checksum(v) for v in values]
    assert len(set(sums)) == len(values)
    assert checkpoint.checksum({"a": [1, (2.5, "x")]}) == checkpoint.checksum({"a": [1, (2.5, "x")]})


def test_extra_subclasses_of_builtins_come_back_as_builtins(tmp_path):
    import collections
    import enum

    Pair = collections.namedtuple("Pair", "x y")

    class Color(enum.IntEnum):
        RED = 2

    class Name(str):
        pass

    _save_tiny(tmp_path, extra={"pair": Pair(np.float64(1.5), 2), "color": Color.RED, "name": Name("n")})
    extra = checkpoint.load(str(tmp_path), models={}, optimizers={})["extra"]
    assert extra == {"pair": (1.5, 2), "color": 2, "name": "n"}
    assert [type(extra[k]) for k in ("pair", "color", "name")] == [tuple, int, str]


def test_load_names_every_missing_entry(tmp_path):
    _save_tiny(tmp_path)
    a2, c2 = tiny_models()
    with pytest.raises(ValueError, match=r"lacks \['models.ghost'\]"):
        checkpoint.load(str(tmp_path), models={"actor": a2, "ghost": c2}, optimizers={})
    with pytest.raises(ValueError, match=r"lacks \['models.ghost', 'optimizers.ghost'\]"):
        checkpoint.load(str(tmp_path), models={"ghost": c2}, optimizers={"ghost": torch.optim.SGD(a2.parameters())})


def test_state_dict_round_trip_and_missing_file(tmp_path):
    actor, _ = tiny_models()
    path = str(tmp_path / "sft.pt")
    checkpoint.save_state_dict(actor.state_dict(), path)
    back = checkpoint.load_state_dict(path)
    sd = actor.state_dict()
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope.pt")):
        checkpoint.load_state_dict(tmp_path / "nope.pt")


def test_unreadable_files_say_why(tmp_path, monkeypatch):
    path, *_ = _save_tiny(tmp_path)
    open(path, "wb").close()
    with pytest.raises(CorruptCheckpointError, match=f"{path} is empty"):
        checkpoint.read(path)
    _save_tiny(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"cannot be read safely .*: UnpicklingError: \S"):
        torch.save({"x": _Evil()}, path)
        checkpoint.read(path)

    _save_tiny(tmp_path)
    for err, tail in ((OSError("disk went away\nsecond line"), "OSError: disk went away$"), (OSError(), "OSError: $")):
        monkeypatch.setattr(checkpoint.torch, "load", lambda *a, err=err, **k: (_ for _ in ()).throw(err))
        with pytest.raises(CorruptCheckpointError, match=f"{path} cannot be read safely .*{tail}"):
            checkpoint.read(path)  # the cause's first line only (or nothing when it has no message)


def test_wrong_format_or_non_plain_data_is_refused(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"format": checkpoint.FORMAT - 1, "data": {}, "sha256": checkpoint.checksum({})}, path)
    with pytest.raises(CorruptCheckpointError, match=f"{path} is not a compactionrl_fast checkpoint of format"):
        checkpoint.read(path)
    torch.save({"format": checkpoint.FORMAT, "data": {"x": b"ab"}, "sha256": ""}, path)  # bytes load safely
    with pytest.raises(CorruptCheckpointError, match=rf"{path}: checkpoint payload\['x'\]: bytes is not plain"):
        checkpoint.read(path)


def test_cuda_rng_is_saved_only_once_cuda_is_initialised_and_restored(monkeypatch):
    """The CUDA branch, with torch.cuda faked (no GPU here)."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.ones(3, dtype=torch.uint8)])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    assert "cuda" not in checkpoint.rng_state()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    state = checkpoint.rng_state()
    assert torch.equal(state["cuda"][0], torch.ones(3, dtype=torch.uint8))
    checkpoint.set_rng_state(state)
    assert len(restored) == 1 and restored[0] is state["cuda"]
    del state["cuda"]
    checkpoint.set_rng_state(state)  # a checkpoint from a CPU run restores nothing on CUDA
    assert len(restored) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "cuda" not in checkpoint.rng_state()
