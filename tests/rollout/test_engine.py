"""TransformersEngine on a tiny random Llama: exact log-probs, sampling modes, stop/caps, prefix reuse,
weight loading, validation."""
import pytest
import torch

from compactionrl_fast.envs import tiny_llama
from compactionrl_fast.rollout import TransformersEngine
from compactionrl_fast.rollout.engines.transformers_engine import sample_tokens

V = 40


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, seed=3)


def prompts_and_caps(n=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (int(torch.randint(1, 40, (), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    caps = [5, 0, 12, 3, 20, 7, 1][:n]
    return prompts, caps


@torch.no_grad()
def fresh_logprobs(model, prompt, tokens, temperature=1.0):
    seq = torch.tensor(prompt + tokens)[None]
    logits = model(input_ids=seq).logits[0].float() / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(logits, -1)
    return lp[len(prompt) - 1:-1].gather(1, seq[0, len(prompt):, None])[:, 0]


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9), (0.0, 1.0)])
def test_logprobs_equal_a_fresh_forward(model, temperature, top_p, lean):
    eng = TransformersEngine(model, lean=lean)
    assert eng.lean == lean
    prompts, caps = prompts_and_caps()
    outs = eng.generate(prompts, caps, temperature=temperature, top_p=top_p, stop_token_ids=[2, 7], seed=0)
    for p, o, c in zip(prompts, outs, caps):
        assert len(o.token_ids) == len(o.logprobs) <= c
        if o.token_ids:
            ref = fresh_logprobs(model, p, o.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(o.logprobs), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("lean", [True, False])
def test_stop_tokens_and_caps(model, lean):
    eng = TransformersEngine(model, lean=lean)
    prompts, caps = prompts_and_caps()
    stops = {2, 7, 11, 19}
    for seed in range(3):
        outs = eng.generate(prompts, caps, stop_token_ids=sorted(stops), seed=seed)
        for o, c in zip(outs, caps):
            assert not any(t in stops for t in o.token_ids[:-1])  # nothing after a stop
            if o.finish_reason == "stop":
                assert o.token_ids[-1] in stops
            else:
                assert len(o.token_ids) == c and (not o.token_ids or o.token_ids[-1] not in stops)


@pytest.mark.parametrize("lean", [True, False])
def test_greedy_batched_equals_one_by_one(model, lean):
    eng = TransformersEngine(model, prefix_cache=False, lean=lean)
    prompts, caps = prompts_and_caps()
    batched = eng.generate(prompts, caps, temperature=0.0, stop_token_ids=[2])
    for p, c, b in zip(prompts, caps, batched):
        single = eng.generate([p], [c], temperature=0.0, stop_token_ids=[2])[0]
        assert single.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(single.logprobs), torch.tensor(b.logprobs), rtol=0, atol=2e-5)


def test_tiny_top_p_is_greedy_and_seed_reproducible(model):
    eng = TransformersEngine(model)
    prompts, caps = prompts_and_caps()
    greedy = eng.generate(prompts, caps, temperature=0.0)
    nucleus = eng.generate(prompts, caps, temperature=1.0, top_p=1e-6, seed=5)
    assert [g.token_ids for g in greedy] == [n.token_ids for n in nucleus]
    a = eng.generate(prompts, caps, seed=11)
    b = eng.generate(prompts, caps, seed=11)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


@pytest.mark.parametrize("lean", [True, False])
def test_prefix_reuse_matches_full_prefill(model, lean):
    """Multi-turn conversations with cache_keys give the same tokens and log-probs as prefilling all."""
    cached, plain = TransformersEngine(model, lean=lean), TransformersEngine(model, prefix_cache=False, lean=False)
    g = torch.Generator().manual_seed(4)
    convs = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in (3, 9, 17, 1, 30)]
    for turn in range(4):
        caps = [4, 1, 6, 3, 2]
        a = cached.generate(convs, caps, temperature=0.0, stop_token_ids=[2], cache_keys=list(range(5)))
        b = plain.generate(convs, caps, temperature=0.0, stop_token_ids=[2])
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=2e-5)
        for i, x in enumerate(a):  # next prompt: the completion plus a few new "observation" tokens
            extra = torch.randint(3, V, (1 + (i + turn) % 5,), generator=g).tolist()
            convs[i] = convs[i] + x.token_ids + extra if turn != 2 or i != 3 else convs[i][:2] + extra
        assert len(cached._store) == 5


def test_cache_dropped_when_weights_change(model):
    m = tiny_llama(V, seed=8)
    eng = TransformersEngine(m)
    p = [[5, 6, 7, 8, 9]]
    eng.generate(p, 3, temperature=0.0, cache_keys=[0])
    assert eng._store
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(input_ids=torch.tensor(p)).logits.sum().backward()
    opt.step()  # in-place update: the stored KV is stale
    out = eng.generate([p[0] + [10]], 3, temperature=0.0, cache_keys=[0])[0]
    torch.testing.assert_close(torch.tensor(out.logprobs), fresh_logprobs(m, p[0] + [10], out.token_ids),
                               rtol=0, atol=2e-5)


def test_load_weights_and_training_flag(model):
    other = tiny_llama(V, seed=9)
    m = tiny_llama(V, seed=3)
    m.train()
    eng = TransformersEngine(m)
    prompts, caps = prompts_and_caps()
    eng.load_weights(other.state_dict())
    assert m.training  # restored after generation below
    outs = eng.generate(prompts, caps, temperature=0.0)
    assert m.training
    ref = TransformersEngine(other).generate(prompts, caps, temperature=0.0)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_validation(model):
    eng = TransformersEngine(model)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1, 2], [3]], [1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1, 2]], -1)
    with pytest.raises(ValueError, match="cache_keys"):
        eng.generate([[1, 2]], 1, cache_keys=[0, 1])
    with pytest.raises(ValueError, match="non-empty"):
        eng.generate([[]], 1)
    assert eng.generate([[1, 2]], 0)[0].token_ids == []


def test_sample_tokens_logprob_is_pre_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    tok, lp = sample_tokens(logits, 0.5, 0.3, torch.Generator().manual_seed(0))
    assert int(tok) == 0
    assert float(lp) == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[0, 0]), abs=1e-6)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2"])
def test_lean_path_other_configs(arch):
    """The lean forward on grouped-query attention and on Qwen2 (attention biases) equals the HF forward."""
    import transformers

    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    if arch == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).eval()
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, rope_theta=500.0)).eval()
    eng = TransformersEngine(m)
    assert eng.lean
    prompts, caps = prompts_and_caps()
    outs = eng.generate(prompts, caps, seed=0, cache_keys=list(range(len(prompts))))
    outs2 = eng.generate([p + o.token_ids + [5, 6] for p, o in zip(prompts, outs)], caps, seed=1,
                         cache_keys=list(range(len(prompts))))
    for p, o, o2 in zip(prompts, outs, outs2):
        if o2.token_ids:
            ref = fresh_logprobs(m, p + o.token_ids + [5, 6], o2.token_ids)
            torch.testing.assert_close(torch.tensor(o2.logprobs), ref, rtol=0, atol=2e-5)
