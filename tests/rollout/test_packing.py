"""pack(): the PackedBatch contract, and end to end: recorded rollout log-probs equal a fresh forward of
the same model on the packed batch (with and without prefix sharing)."""
import pytest
import torch

from compactionrl_fast.envs import MemoryEnv, expert_rollouts, memory_config, memory_tokenizer, tiny_llama
from compactionrl_fast.packing import pack
from compactionrl_fast.reference import place_final_rewards
from compactionrl_fast.rollout import Rollout, Segment, TransformersEngine, run_rollouts

from .helpers import FixedEngine, ListEnv, Recorder, check_fidelity, packed_logprobs

TOK = memory_tokenizer()


@pytest.fixture(scope="module")
def model_rollouts():
    """Rollouts of a random tiny Llama on the memory task plus a failing env: long junk responses fill
    the budget, so there are compactions, truncations and every segment kind."""
    model = tiny_llama(len(TOK), seed=1)
    eng = Recorder(TransformersEngine(model, pad_token_id=TOK.pad_token_id))
    envs = [MemoryEnv(n_digits=3 + i % 5, n_fillers=5 + 3 * i, n_blank=i % 2) for i in range(9)]
    envs.append(ListEnv(["la"] * 9, fail_at=1))
    cfg = memory_config(temperature=1.0, max_turns=12, seed=7)
    ros = run_rollouts(eng, envs, TOK, cfg, seeds=list(range(100, 110)))
    return model, eng, ros, cfg


def check_layout(b, ros):
    T, S, R = b.num_tokens, b.segment_kind.numel(), len(ros)
    assert b.input_ids.dtype == b.position_ids.dtype == b.cu_attn.dtype == b.cu_seqlens.dtype == torch.int64
    assert b.loss_mask.dtype == torch.bool and b.rollout_logprobs.dtype == b.rewards.dtype == torch.float32
    assert b.segment_kind.dtype == torch.int8 and b.rollout_rewards.shape == (R,)
    assert b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == T and (b.cu_seqlens.diff() >= 0).all()
    assert b.cu_attn[0] == 0 and b.cu_attn[-1] == T and (b.cu_attn.diff() > 0).all()
    assert b.cu_segments.tolist() == [0] + list(torch.tensor([len(r.segments) for r in ros]).cumsum(0).tolist())
    assert b.cu_segments[-1] == S and b.segment_attn.shape == (S,)
    # every GAE segment is a contiguous range inside its attention sequence
    for s in range(S):
        a = int(b.segment_attn[s])
        if b.cu_seqlens[s + 1] > b.cu_seqlens[s]:
            assert b.cu_attn[a] <= b.cu_seqlens[s] and b.cu_seqlens[s + 1] <= b.cu_attn[a + 1]
    # positions restart per attention sequence; nothing trainable at a sequence start
    for a0, a1 in zip(b.cu_attn[:-1].tolist(), b.cu_attn[1:].tolist()):
        assert b.position_ids[a0:a1].tolist() == list(range(a1 - a0))
        assert not b.loss_mask[a0]
    assert (b.rollout_logprobs[~b.loss_mask] == 0).all()
    ref = place_final_rewards(b.rollout_rewards, b.loss_mask, b.cu_seqlens, b.cu_segments)
    torch.testing.assert_close(b.rewards.double(), ref)


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_recorded_logprobs_equal_fresh_forward(model_rollouts, prefix_sharing):
    model, eng, ros, cfg = model_rollouts
    assert {r.finish_reason for r in ros} >= {"error"} and sum(r.compactions for r in ros) >= 5
    assert any(r.truncated for r in ros)
    b = pack(ros, prefix_sharing=prefix_sharing, mask_errors=False)
    check_layout(b, ros)
    assert b.num_trainable == sum(r.num_trainable for r in ros)
    fresh = packed_logprobs(model, b)
    m = b.loss_mask
    torch.testing.assert_close(b.rollout_logprobs[m], fresh[m], rtol=0, atol=1e-4)
    assert (b.rollout_logprobs[m] < 0).all()
    kinds = b.token_segment_kind()
    assert bool(m[kinds == 1].any()) and bool(m[kinds == 0].any())
    if prefix_sharing:  # every summary shares its window's attention sequence
        n_sum = int((b.segment_kind == 1).sum())
        assert b.cu_attn.numel() - 1 == b.segment_kind.numel() - n_sum
        assert b.num_tokens < pack(ros).num_tokens
    else:
        assert b.cu_attn.tolist() == b.cu_seqlens.tolist()


def test_segments_are_the_sampled_tokens(model_rollouts):
    model, eng, ros, cfg = model_rollouts
    check_fidelity(ros, eng.calls, atol=0.0)
    for r in ros:
        assert all(len(s) <= cfg.budget for s in r.segments if s.kind == "exec")
        assert [s.kind for s in r.segments] == ["exec", "summary"] * r.compactions + ["exec"]
        assert r.summary_lengths == [s.num_trainable for s in r.segments if s.kind == "summary"]


def test_masking_options(model_rollouts):
    _, _, ros, _ = model_rollouts
    full = pack(ros, mask_errors=False)
    b = pack(ros)  # errors masked by default
    err = [i for i, r in enumerate(ros) if r.error is not None]
    assert err and b.errored[err].all()
    for r in err:
        lo, hi = int(b.cu_seqlens[b.cu_segments[r]]), int(b.cu_seqlens[b.cu_segments[r + 1]])
        assert not b.loss_mask[lo:hi].any() and full.loss_mask[lo:hi].any()
    t = pack(ros, mask_truncated=True)
    for r, ro in enumerate(ros):
        lo, hi = int(t.cu_seqlens[t.cu_segments[r]]), int(t.cu_seqlens[t.cu_segments[r + 1]])
        assert bool(t.loss_mask[lo:hi].any()) == (not ro.truncated and ro.error is None and ro.num_trainable > 0)
    ns = pack(ros, train_summaries=False)
    assert not ns.loss_mask[ns.token_segment_kind() == 1].any()
    st = pack(ros, reward_mode="stitched")
    ref = place_final_rewards(st.rollout_rewards, st.loss_mask, st.cu_seqlens, st.cu_segments, mode="stitched")
    torch.testing.assert_close(st.rewards.double(), ref)
    assert b.compactions.tolist() == [r.compactions for r in ros]
    assert b.truncated.tolist() == [r.truncated for r in ros] and b.finish_reasons == [r.finish_reason for r in ros]


def test_expert_batch_layout():
    ros = expert_rollouts(6, drop_oldest_p=0.0)
    for sharing in (False, True):
        b = pack(ros, prefix_sharing=sharing)
        check_layout(b, ros)
        assert b.success.all() and (b.compactions == 2).all() and (b.rollout_rewards == 1).all()
        assert b.segment_kind.tolist() == [0, 1, 0, 1, 0] * 6
        # paper mode: every segment's last trainable token carries the final reward
        assert int((b.rewards != 0).sum()) == 5 * 6
    shared = pack(ros, prefix_sharing=True)
    assert shared.num_tokens / 6 < 330 < pack(ros).num_tokens / 6


def test_empty_and_segmentless_rollouts():
    ok = run_rollouts(FixedEngine(TOK), [ListEnv(["la", "lo"])], TOK, memory_config())[0]
    failed = Rollout(finish_reason="error", error="boom")
    b = pack([failed, ok, failed])
    assert b.cu_segments.tolist() == [0, 0, 1, 1] and b.num_tokens == len(ok.segments[0])
    e = pack([])
    assert e.num_tokens == 0 and e.cu_seqlens.tolist() == [0] and e.cu_segments.tolist() == [0]


def test_pack_rejects_bad_records():
    good = Segment("exec", [1, 2, 3], [False, True, True], [0.0, -1.0, -2.0])
    with pytest.raises(ValueError, match="reward_mode"):
        pack([Rollout(segments=[good])], reward_mode="bogus")
    with pytest.raises(ValueError, match="trainable"):
        pack([Rollout(segments=[Segment("exec", [1], [True], [-1.0])])])
    with pytest.raises(ValueError, match="length"):
        pack([Rollout(segments=[Segment("exec", [1, 2], [False], [0.0])])])
    bad_sum = Segment("summary", [1, 2, 9, 4], [False, False, False, True], [0, 0, 0, -1.0], shared_prefix=3)
    with pytest.raises(ValueError, match="shared prefix"):
        pack([Rollout(segments=[good, bad_sum])], prefix_sharing=True)
    pack([Rollout(segments=[good, bad_sum])])  # without sharing the summary stands alone


def test_per_rollout_fields_and_reward_modes(model_rollouts):
    """The per-rollout fields (turns, errors, rewards) and `reward_mode` reach the batch (mutation testing
    found them unchecked)."""
    model, eng, ros, cfg = model_rollouts
    b = pack(ros, mask_errors=False)
    assert b.num_turns.dtype == torch.int64 and b.num_turns.tolist() == [len(r.turns) for r in ros]
    assert b.errors == [r.error for r in ros] and any(e for e in b.errors)
    assert b.rollout_rewards.tolist() == pytest.approx([float(r.reward) for r in ros])
    experts = expert_rollouts(4, drop_oldest_p=0.0)  # reward 1 each, 5 segments
    st = pack(experts, reward_mode="stitched")
    ref = place_final_rewards(st.rollout_rewards, st.loss_mask, st.cu_seqlens, st.cu_segments, mode="stitched")
    torch.testing.assert_close(st.rewards.double(), ref)
    assert int((st.rewards != 0).sum()) == 4  # one reward per rollout, not one per segment as in "paper"
    # the batch says where its rewards are, so the trainer reuses them only in that mode
    assert st.reward_mode == "stitched" and pack(experts).reward_mode == "paper" == b.reward_mode
    with pytest.raises(TypeError):
        pack(ros[0])  # one Rollout, not a list of them


def check_dtypes(b):
    """Every tensor of the batch has the dtype PackedBatch documents, whatever the batch size (an empty list
    gives torch.tensor's float32 default unless pack names the dtype)."""
    want = {"input_ids": torch.int64, "position_ids": torch.int64, "cu_attn": torch.int64,
            "cu_seqlens": torch.int64, "cu_segments": torch.int64, "segment_attn": torch.int64,
            "loss_mask": torch.bool, "rollout_logprobs": torch.float32, "rewards": torch.float32,
            "segment_kind": torch.int8, "rollout_rewards": torch.float32, "success": torch.bool,
            "truncated": torch.bool, "errored": torch.bool, "compactions": torch.int64, "num_turns": torch.int64}
    assert {k: getattr(b, k).dtype for k in want} == want
    assert b.token_segment_kind().dtype == torch.int8


def test_dtypes_hold_for_empty_batches_and_integer_rewards():
    check_dtypes(pack([]))
    check_dtypes(pack([Rollout(finish_reason="error", error="boom")]))  # one rollout, no segments
    seg = Segment("exec", [1, 2, 3], [False, True, True], [0, -1, -2])  # integer log-probs and reward
    b = pack([Rollout(segments=[seg], reward=1, compactions=0)])
    check_dtypes(b)
    assert b.rollout_rewards.tolist() == [1.0] and b.rewards.tolist() == [0.0, 0.0, 1.0]


def test_token_segment_kind_repeats_each_segment_kind_over_its_tokens():
    ros = expert_rollouts(2, drop_oldest_p=0.0)
    b = pack(ros, prefix_sharing=True)
    lens = b.cu_seqlens.diff().tolist()
    want = [k for k, n in zip(b.segment_kind.tolist(), lens) for _ in range(n)]
    assert b.token_segment_kind().tolist() == want and 1 in want


def test_list_fields_reach_the_batch():
    ros = expert_rollouts(3, drop_oldest_p=0.0)
    for i, r in enumerate(ros):
        r.info = {"id": i}
    b = pack(ros)
    assert b.summary_lengths == [r.summary_lengths for r in ros] and all(b.summary_lengths)
    assert b.infos == [{"id": i} for i in range(3)]
    b.infos[0]["id"] = 9  # a copy: the batch does not alias the records
    assert ros[0].info == {"id": 0}


def test_empty_leading_segment_belongs_to_attention_sequence_zero():
    empty = Segment("exec", [], [], [])
    seg = Segment("exec", [1, 2, 3], [False, True, True], [0.0, -1.0, -2.0])
    b = pack([Rollout(segments=[empty, seg]), Rollout(segments=[seg])])
    assert b.segment_attn.tolist() == [0, 0, 1] and b.cu_attn.tolist() == [0, 3, 6]
    check_layout(b, [Rollout(segments=[empty, seg]), Rollout(segments=[seg])])


def test_prefix_sharing_edge_cases():
    win = Segment("exec", [5], [False], [0.0])
    one = Segment("summary", [5, 6, 7], [False, False, True], [0.0, 0.0, -1.0], shared_prefix=1)
    b = pack([Rollout(segments=[win, one])], prefix_sharing=True)  # a one-token shared prefix is shared
    assert b.cu_attn.tolist() == [0, 3] and b.cu_seqlens.tolist() == [0, 1, 3] and b.segment_attn.tolist() == [0, 0]
    alone = Segment("summary", [8, 6, 7], [False, False, True], [0.0, 0.0, -1.0], shared_prefix=0)
    b = pack([Rollout(segments=[win, alone])], prefix_sharing=True)  # shared_prefix 0: its own sequence
    assert b.cu_attn.tolist() == [0, 1, 4] and b.segment_attn.tolist() == [0, 1]
    with pytest.raises(ValueError, match="shared prefix"):  # a summary with no window before it
        pack([Rollout(segments=[one])], prefix_sharing=True)
    # a summary cannot share the prefix of another summary, even when the tokens match
    again = Segment("summary", [5, 6, 7, 9, 4], [False] * 4 + [True], [0.0] * 4 + [-1.0], shared_prefix=3)
    with pytest.raises(ValueError, match="shared prefix"):
        pack([Rollout(segments=[win, one, again])], prefix_sharing=True)


def test_pack_rejects_each_mismatched_length_and_non_iterables():
    with pytest.raises(ValueError, match="length"):  # logprobs alone too short
        pack([Rollout(segments=[Segment("exec", [1, 2], [False, True], [0.0])])])
    with pytest.raises(ValueError, match="length"):  # loss_mask alone too short
        pack([Rollout(segments=[Segment("exec", [1, 2], [False], [0.0, -1.0])])])
    for bad in (5, None):
        with pytest.raises(TypeError, match="rollouts must be a list of Rollout records"):
            pack(bad)


def test_pack_puts_the_batch_on_device():
    b = pack(expert_rollouts(1, drop_oldest_p=0.0), device="meta")
    assert b.input_ids.device.type == b.rewards.device.type == b.success.device.type == "meta"
