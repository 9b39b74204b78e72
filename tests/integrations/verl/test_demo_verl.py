"""demo-verl's parts that run without a verl job (compactionrl_fast/app/demo_verl.py, app/export.py): the export
of our models as Hugging Face folders, the recipe in verl keys (docs/verl.md's table, and verl's own config checks
on the overrides), the training data in our trainer's task order, the checkpoint reader's error, the command's
error without verl. The whole job and the evaluator on verl's real checkpoint: tests/integrations/verl/job/.

`python -m tests.integrations.verl.test_demo_verl --update` rewrites docs/verl.md's table."""
import os
import re
import sys

import pytest
import torch

from compactionrl_fast.app import demo_verl as D
from compactionrl_fast.app.demo import demo_config
from compactionrl_fast.app.export import export_actor, export_critic, sft_checkpoint
from compactionrl_fast.envs import memory_tokenizer
from compactionrl_fast.envs.models import tiny_llama
from compactionrl_fast.train.loop import train_seeds

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "verl.md")
BEGIN, END = "<!-- recipe table: begin -->", "<!-- recipe table: end -->"


def test_docs_table_is_the_recipe_of_demo_config():
    text = open(DOC).read()
    assert BEGIN in text and END in text
    assert text.split(BEGIN)[1].split(END)[0].strip() == D.recipe_table(demo_config())


def test_every_setting_that_shapes_training_has_a_row():
    """Each TrainConfig field a run's numbers depend on is named in a row of the recipe (or is a run detail)."""
    details = {"run_dir", "device", "threads", "engine", "log_every", "gap_every", "eval_every", "eval_rollouts",
               "checkpoint_every", "progress", "vllm", "server", "sft"}
    named = " ".join(name for name, *_ in D.recipe(demo_config()))
    for f in demo_config().__dataclass_fields__:
        assert f in details or f in named, f


def test_the_demo_verl_config_is_all_expressible_and_the_demo_is_not():
    cfg = D.demo_verl_config()
    assert all(key for name, _, key, _ in D.recipe(cfg) if name not in ("tis_cap", "sampler_logp_tol", "adam_eps"))
    with pytest.raises(ValueError, match="ppo_minibatches"):
        D.verl_overrides(demo_config(), "/w", 0)
    over = D.verl_overrides(cfg, "/w", 0)
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=224" in over and "critic.ppo_epochs=2" in over
    assert "trainer.critic_warmup=11" in over and "trainer.total_training_steps=70" in over
    assert "+compaction.train_summary_tokens=true" in over
    assert "+compaction.train_summary_tokens=false" in D.verl_overrides(cfg, "/w", 0, train_summary_tokens=False)
    assert "+compaction.rollout.seed=3" in D.verl_overrides(cfg, "/w", 3)
    assert len({o.split("=", 1)[0] for o in over}) == len(over), "a key set twice"


def test_the_overrides_pass_verls_config_checks(tmp_path):
    pytest.importorskip("hydra", reason="hydra: make test-integrations (build/peers)")
    pytest.importorskip("verl.trainer.main_ppo", reason="verl: make test-integrations (build/peers)")
    from tests.integrations.verl.test_docs_launch import compose, validate

    tok = memory_tokenizer()
    export_actor(tiny_llama(len(tok)), tok, str(tmp_path / "actor"))
    export_critic(tiny_llama(len(tok)), tok, str(tmp_path / "critic"))
    cfg = compose(D.verl_overrides(D.demo_verl_config(), str(tmp_path), 0))
    validate(cfg)
    assert cfg.actor_rollout_ref.actor.ppo_epochs == 2 and cfg.actor_rollout_ref.actor.clip_ratio_c == 1e9
    assert list(cfg.actor_rollout_ref.actor.optim.betas) == [0.9, 0.99] and cfg.critic.optim.weight_decay == 0


def test_training_data_is_our_trainers_tasks_in_order(tmp_path):
    pd = pytest.importorskip("pandas", reason="verl's data files need pandas: make test-integrations (build/peers)")

    cfg = D.demo_verl_config(rollouts_per_step=4, steps=3, value_pretrain_steps=2, seed=5)
    n = D.write_data(str(tmp_path), cfg)
    df = pd.read_parquet(tmp_path / "train.parquet")
    want = [s for step in range(5) for s in train_seeds(cfg, step, 0, 4)]
    assert n == 20 and [r["index"] for r in df["extra_info"]] == want


def test_export_round_trip(tmp_path):
    """export_actor: the same logits from the folder; export_critic: the decoder and a zero (or given) head."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    tok = memory_tokenizer()
    actor = tiny_llama(len(tok), seed=3)
    ids = torch.randint(0, len(tok), (1, 30))
    export_actor(actor, tok, str(tmp_path / "a"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    torch.testing.assert_close(again(ids).logits, actor(ids).logits, rtol=0, atol=0)
    export_critic(actor, tok, str(tmp_path / "c"))
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "c", dtype=torch.float32)
    assert not critic(ids).logits.any()
    hidden = actor.model(ids).last_hidden_state
    torch.testing.assert_close(critic.model(ids).last_hidden_state, hidden, rtol=0, atol=0)
    w, b = torch.randn(64), torch.randn(1)
    export_critic(actor, tok, str(tmp_path / "c2"), head=(w, b))
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "c2", dtype=torch.float32)
    torch.testing.assert_close(critic(ids).logits[0, :, 0], hidden[0] @ w + b, rtol=1e-5, atol=1e-5)


def test_sft_checkpoint_is_made_once(tmp_path, monkeypatch):
    folder = str(tmp_path / "sft")
    assert sft_checkpoint(folder, steps=2, threads=1) == folder
    stamp = os.path.getmtime(os.path.join(folder, "crf_export.json"))
    sft_checkpoint(folder, steps=2, threads=1)
    assert os.path.getmtime(os.path.join(folder, "crf_export.json")) == stamp  # reused
    sft_checkpoint(folder, steps=3, threads=1)
    assert os.path.getmtime(os.path.join(folder, "crf_export.json")) != stamp  # another recipe: made again


def test_the_checkpoint_reader_names_the_missing_key(tmp_path):
    with pytest.raises(ValueError, match=r"save_contents=\[model,optimizer,extra,hf_model\]"):
        D.verl_actor(str(tmp_path))
    folder = tmp_path / "actor" / "huggingface"  # what verl writes without hf_model: the config, no weights
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no Hugging Face weights"):
        D.verl_actor(str(tmp_path))


def test_the_command_without_verl_says_what_to_run(monkeypatch, capsys):
    from compactionrl_fast.app import cli, verl_cpu

    monkeypatch.setattr(verl_cpu, "shim_missing", lambda: "verl is not installed in this Python (make demo-verl)")
    assert cli.main(["demo-verl", "--steps", "1"]) == 2
    assert "make demo-verl" in capsys.readouterr().err


def update():
    text = open(DOC).read()
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda m: f"{BEGIN}\n{D.recipe_table(demo_config())}\n{END}",
                 text, flags=re.S)
    open(DOC, "w").write(new)
    print(f"wrote {DOC}")


if __name__ == "__main__" and "--update" in sys.argv:
    update()
