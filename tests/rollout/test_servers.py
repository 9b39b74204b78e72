"""The replica launcher (rollout/servers.py) with fake servers in place of vLLM: free ports, health wait,
a replica that fails to start, and every replica stopped by close(), SIGTERM, Ctrl-C or the parent's death."""
import os
import signal
import subprocess
import sys
import time

import pytest

from compactionrl_fast.rollout.servers import launch, server_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = "tests.rollout.fake_server"


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def wait_dead(pids, s=15):
    t = time.time()
    while any(alive(p) for p in pids) and time.time() - t < s:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def test_launch_two_replicas_serve_and_stop(tmp_path):
    pytest.importorskip("httpx")
    from compactionrl_fast.rollout.engines.server_engine import ServerEngine

    fleet = launch("some/model", 2, entry=FAKE, log_dir=str(tmp_path), startup_timeout_s=60)
    try:
        assert len(set(fleet.urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in fleet.urls)
        eng = ServerEngine(fleet.urls, fleet=fleet)
        assert len(eng.generate([[1, 2, 3]] * 4, 4)) == 4 and eng.requests == 4
        pids = [p.pid for p in fleet.procs]
        eng.close()  # owns the fleet: stops it
        assert wait_dead(pids)
        assert "--skip-tokenizer-init" in open(fleet.logs[0]).readline()
    finally:
        fleet.close()


def test_a_replica_that_exits_fails_the_launch_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code") as e:
        launch("m", 1, entry="no_such_module_here", log_dir=str(tmp_path), startup_timeout_s=60)
    assert "No module named" in str(e.value)
    with pytest.raises(ValueError, match="replicas"):
        launch("m", 0)


def test_server_args():
    a = server_args("m", 8000, kv_cache_gib=0.25, max_model_len=512, chunked_prefill=False)
    assert a[:4] == ["--model", "m", "--host", "127.0.0.1"] and "--no-enable-chunked-prefill" in a
    assert a[a.index("--kv-cache-memory-bytes") + 1] == str(1 << 28) and "processed_logprobs" in a


# Ctrl-C's handler, as in an interactive shell: a shell starts background jobs with SIGINT ignored, and a child
# inherits that (then Python installs no KeyboardInterrupt handler and SIGINT does nothing)
INTERACTIVE = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_replicas_stop_when_the_launcher_is_stopped(how):
    code = (INTERACTIVE + "import time\nfrom compactionrl_fast.rollout.servers import launch\n"
            f"f = launch('m', 2, entry={FAKE!r}, startup_timeout_s=60)\n"
            "print(' '.join(str(p.pid) for p in f.procs), flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(x) for x in pids)
        p.send_signal(getattr(signal, how))
        p.wait(30)
        assert wait_dead(pids), how
    finally:
        p.kill()


def test_the_command_prints_the_urls_and_stops_the_replicas_on_ctrl_c():
    import urllib.request

    code = (INTERACTIVE + f"import sys, compactionrl_fast.rollout.servers as s; s.ENTRY = {FAKE!r}; "
            "sys.exit(s.main(['some/model', '--replicas', '2']))")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        urls = p.stdout.readline().split()
        assert len(urls) == 2
        for u in urls:
            with urllib.request.urlopen(u + "/v1/models", timeout=5) as r:
                assert r.status == 200
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0, p.stderr.read()[-2000:]
        for u in urls:
            with pytest.raises(OSError):
                urllib.request.urlopen(u + "/v1/models", timeout=2)
    finally:
        p.kill()


def test_cpu_binds_one_per_replica(tmp_path):
    with pytest.raises(ValueError, match="cpu_binds"):
        launch("m", 2, entry=FAKE, cpu_binds=["0"])
    fleet = launch("m", 2, entry=FAKE, log_dir=str(tmp_path), cpu_binds=["0", "1"], startup_timeout_s=60)
    try:
        envs = [open(f"/proc/{p.pid}/environ", "rb").read().split(b"\0") for p in fleet.procs]
        assert [[e for e in env if e.startswith(b"VLLM_CPU_OMP_THREADS_BIND=")] for env in envs] == \
            [[b"VLLM_CPU_OMP_THREADS_BIND=0"], [b"VLLM_CPU_OMP_THREADS_BIND=1"]]
        assert all(b"VLLM_SERVER_DEV_MODE=1" in env for env in envs)
    finally:
        fleet.close()
