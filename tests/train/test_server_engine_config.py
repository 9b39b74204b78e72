"""`engine: server` in the trainer, against fake completion servers (tests/rollout/fake_server.py): config
validation, make_engine on server.urls and on server.replicas (the launcher, with the fake server in place
of vLLM), `fit` running async episodes and syncing every replica; the guard names each replica's gap."""
import pytest

pytest.importorskip("httpx")

from compactionrl_fast.app import runner  # noqa: E402
from compactionrl_fast.rollout import servers  # noqa: E402
from compactionrl_fast.train.checks import ConfigError  # noqa: E402
from compactionrl_fast.train.config_load import update  # noqa: E402
from compactionrl_fast.train.engines import make_engine  # noqa: E402
from compactionrl_fast.train.model import critic_from_actor  # noqa: E402
from compactionrl_fast.train.sync import SamplerMismatchError, check_sampler  # noqa: E402
from compactionrl_fast.train.loop import fit  # noqa: E402
from compactionrl_fast.train.trainer import make_state  # noqa: E402

from ..rollout.fake_server import FakeServer  # noqa: E402
from ._tiny import tiny_train_config  # noqa: E402


def test_config_validation(tmp_path):
    base = tiny_train_config(tmp_path / "run")
    with pytest.raises(ConfigError, match="exactly one of server.urls"):
        update(base, {"engine": "server"})
    with pytest.raises(ConfigError, match="exactly one of server.urls"):
        update(base, {"engine": "server", "server.urls": ["http://a:1"], "server.replicas": 2})
    with pytest.raises(ConfigError, match="server.urls"):
        update(base, {"server.urls": ["ftp://a"]})
    with pytest.raises(ConfigError, match="server.max_in_flight"):
        update(base, {"server.max_in_flight": 0})
    cfg = update(base, {"engine": "server", "server.urls": "http://a:1, http://b:2"})
    assert cfg.server.urls == "http://a:1, http://b:2"
    assert update(base, {"engine": "server", "server.replicas": 2}).server.replicas == 2


def _fit(cfg, engine):
    tok, make_envs, rcfg = runner.task(cfg)
    actor = runner.build(cfg, tok)
    state = make_state(cfg, actor, critic_from_actor(actor))
    rows = []

    class Log:
        def log(self, step, metrics):
            rows.append(dict(metrics))

    fit(state, engine=engine, make_envs=make_envs, tokenizer=tok, rollout_cfg=rcfg, pack=runner.packer(cfg),
        run_dir=cfg.run_dir, log=Log())
    return rows, actor


@pytest.mark.parametrize("source", ["urls", "replicas"])
def test_fit_with_the_server_engine(tmp_path, monkeypatch, source):
    fakes = []
    if source == "urls":
        fakes = [FakeServer(), FakeServer()]
        over = {"server.urls": ",".join(f.url for f in fakes)}
    else:
        monkeypatch.setattr(servers, "ENTRY", "tests.rollout.fake_server")
        over = {"server.replicas": 2, "server.startup_timeout_s": 60.0}
    # the fake servers' log-probs are not the actor's: the guard is off here (tests/vllm checks it for real)
    cfg = update(tiny_train_config(tmp_path / "run", steps=2, value_pretrain_steps=1),
                 {"engine": "server", "sampler_logp_tol": None, **over})
    tok, _, _ = runner.task(cfg)
    engine = make_engine(cfg, runner.build(cfg, tok), tok)
    try:
        assert engine.async_episodes and len(engine.urls) == 2
        rows, _ = _fit(cfg, engine)
        assert len(rows) == 3 and all(r["time/weight_sync_s"] > 0 for r in rows)
        st = engine.stats()
        assert all(s["ok"] > 0 and s["alive"] for s in st.values())  # both replicas served
        if fakes:
            assert [len(f.reloads) for f in fakes] == [1 + 2, 1 + 2]  # start of RL + each actor update
        assert engine.requests == sum(s["ok"] for s in st.values())
        pids = [p.pid for p in engine.fleet.procs] if engine.fleet else []
    finally:
        engine.close()
        for f in fakes:
            f.stop()
    if pids:
        from ..rollout.test_servers import wait_dead

        assert wait_dead(pids)


def test_the_guard_names_each_replica(tmp_path):
    a, b = FakeServer(), FakeServer()
    cfg = tiny_train_config(tmp_path / "run")
    tok, _, _ = runner.task(cfg)
    actor = runner.build(cfg, tok)
    from compactionrl_fast.rollout.engines.server_engine import ServerEngine

    eng = ServerEngine([a.url, b.url])
    try:
        eng.generate([[1, 5, 6, 7]], 4)
        with pytest.raises(SamplerMismatchError) as e:
            check_sampler(0.5, 1e-3, 3, eng, actor=actor)
        assert f"{a.url}: " in str(e.value) and f"{b.url}: " in str(e.value) and "> tol" in str(e.value)
        with pytest.raises(SamplerMismatchError) as e:
            check_sampler(0.5, 1e-3, 3, eng)  # no actor: the old message
        assert "Per replica" not in str(e.value)
    finally:
        eng.close()
        a.stop(), b.stop()
