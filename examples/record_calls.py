"""Train on a harness of one's own: record its LLM calls, turn each episode into a Rollout, pack them.

The agent below is not the built-in loop: it keeps a list of chat messages, renders them with the
tokenizer's chat template for every call, and compacts on its own (when the context is nearly full it asks
for a summary and restarts from the task plus the summary). All it takes to train on it is a wrapper that
logs every call's prompt ids, completion ids and log-probs (`record`), and `rollout_from_calls`.

Runs offline: `FakeClient` stands in for an OpenAI-compatible completions endpoint that takes a token-id
prompt and returns the sampled ids and their log-probs (the built-in memory task's scripted expert
answers). With a real server, adapt `record` to where your server puts the ids (docs/calls.md).

    PYTHONPATH=. python examples/record_calls.py
"""
from types import SimpleNamespace

from compactionrl_fast import Call, pack, rollout_from_calls
from compactionrl_fast.envs import MemoryEnv, ScriptedExpert, memory_tokenizer

TOK = memory_tokenizer()
BUDGET, THRESHOLD, MAX_TOKENS = 128, 40, 16
SUMMARY_REQUEST = "summarize"


def encode(text):
    return TOK.encode(text, add_special_tokens=False)


def render(messages, gen=False):
    """Token ids of a chat, as the policy sees it."""
    text = TOK.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                   add_generation_prompt=gen)
    return encode(text)


class FakeClient:
    """client.completions.create(model=, prompt=[ids], max_tokens=, logprobs=) -> an object with
    choices[0].text / .token_ids / .logprobs.token_logprobs / .finish_reason."""

    def __init__(self, seed=0):
        self.policy = ScriptedExpert(drop_oldest_p=0.3, seed=seed)
        self.completions = SimpleNamespace(create=self._create)

    def _create(self, *, model, prompt, max_tokens, logprobs=1, **kw):
        g = self.policy.generate([list(prompt)], max_tokens)[0]
        lps = [-0.05] * len(g.token_ids)  # a real server reports the sampler's log-probs
        choice = SimpleNamespace(text=TOK.decode(g.token_ids, skip_special_tokens=True), token_ids=g.token_ids,
                                 logprobs=SimpleNamespace(token_logprobs=lps), finish_reason=g.finish_reason)
        return SimpleNamespace(choices=[choice])


def record(create, log):
    """Wrap `create` so that every call is appended to `log` as a Call; `is_summary=` (not sent to the
    server) marks summary requests."""
    def wrapped(*, is_summary=False, **kw):
        out = create(**kw)
        c = out.choices[0]
        log.append(Call(list(kw["prompt"]), list(c.token_ids), list(c.logprobs.token_logprobs),
                        is_summary=is_summary, finish_reason=c.finish_reason))
        return out
    return wrapped


def play(create, env, seed):
    """One episode of the agent. Returns (final context ids, reward, info)."""
    system, task = env.reset(seed)
    messages = [("system", system), ("user", task)]
    reward, info = 0.0, {}
    for _ in range(40):
        if BUDGET - len(render(messages)) < THRESHOLD:  # compact: summary, then task + summary
            out = create(model="policy", prompt=render(messages + [("user", SUMMARY_REQUEST)], gen=True),
                         max_tokens=MAX_TOKENS, logprobs=1, is_summary=True)
            messages = [("system", system), ("user", f"{task} resume {out.choices[0].text}")]
        out = create(model="policy", prompt=render(messages, gen=True), max_tokens=MAX_TOKENS, logprobs=1)
        messages.append(("assistant", out.choices[0].text))
        obs, done, r, *rest = env.step(out.choices[0].text)
        reward += r
        info.update(rest[0] if rest else {})
        if done:
            break
        messages.append(("user", obs))
    return render(messages), reward, info


def main(n=4, verbose=True):
    client = FakeClient()
    rollouts = []
    for seed in range(n):
        log = []
        final, reward, info = play(record(client.completions.create, log), MemoryEnv(), seed)
        ro = rollout_from_calls(log, reward, summary_suffix=render([("user", SUMMARY_REQUEST)], gen=True),
                                final_context=final, budget=BUDGET, info=info,
                                decode=lambda ids: TOK.decode(ids, skip_special_tokens=True))
        rollouts.append(ro)
        if verbose:
            print(f"episode {seed}: {len(log)} calls, {ro.compactions} compactions, reward {ro.reward}, "
                  f"segments {[s.kind for s in ro.segments]}, summaries {ro.summaries}")
    batch = pack(rollouts, prefix_sharing=True)
    if verbose:
        print(f"packed: {batch.num_tokens} tokens, {batch.num_trainable} trainable, "
              f"{batch.segment_kind.numel()} segments, {batch.cu_attn.numel() - 1} attention sequences")
    return rollouts, batch


if __name__ == "__main__":
    main()
