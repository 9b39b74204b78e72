"""`generate(args, sample, sampling_params, evaluation=False)`: the compaction loop as slime's generate.

slime calls it per prompt with `--custom-generate-function-path compactionrl_fast.integrations.slime.generate`.
It runs one episode of the package's compaction loop (`rollout.episodes.arun_episodes`, the loop's own
steps: generate, observe, summarise when the context nears the budget, rebuild with the last k turns)
against slime's SGLang router, on an environment built by the function that `compaction_env` names, and
returns one `Sample` per segment (execution windows and summaries, chronological) that share a
`rollout_id`, carry the segment index in `metadata["round_number"]` and the episode's reward (so slime does
not score them again). `samples_from_rollout` and `samples_from_calls` make the same samples from a
`Rollout` or a harness's call logs (docs/calls.md).
"""
from __future__ import annotations

import copy
import functools

from ...rollout.calls import rollout_from_calls
from ...rollout.compaction import ChatFormat
from ...rollout.config import RolloutConfig
from ...rollout.episodes import arun_episodes
from ._options import get, load_object
from .engine import RolloutAborted, SGLangEngine

_STATUS = {"done": "COMPLETED", "max_turns": "TRUNCATED", "context_full": "TRUNCATED", "error": "FAILED"}


def _sample_class():
    try:
        from slime.utils.types import Sample
    except ImportError as e:
        raise ImportError("compactionrl_fast.integrations.slime.generate needs slime (slime.utils.types)") from e
    if "rollout_id" not in getattr(Sample, "__dataclass_fields__", {}):
        raise ValueError("this slime's Sample has no rollout_id: the segments of a rollout cannot be linked; "
                         "use slime 0.3.1 at 624b824 or later")
    return Sample


def samples_from_rollout(rollout, sample, *, rollout_id=None, decode=None) -> list:
    """One slime Sample per segment of `rollout` (a `Rollout` of the compaction loop or `rollout_from_calls`).

    Each is a shallow copy of `sample` (the prompt's Sample) with: `tokens` the segment's attention sequence,
    the response from its first trainable token on (`response_length`, `loss_mask` 0 on observation tokens,
    `rollout_log_probs`), `reward` the episode's, `status` from its finish reason (done: COMPLETED,
    max_turns / context_full: TRUNCATED, error: FAILED), `rollout_id` (default `sample.rollout_id`, else
    `sample.index`) and `metadata["round_number"]` = the segment's index (what `compute_advantages` reads).
    `decode`: optional ids -> str for `Sample.response`.
    """
    Sample = _sample_class()
    rid = rollout_id if rollout_id is not None else (sample.rollout_id if sample.rollout_id is not None
                                                     else sample.index)
    if rid is None:
        raise ValueError("samples_from_rollout: the rollout needs an id (rollout_id=, sample.rollout_id or "
                         "sample.index)")
    status = getattr(Sample.Status, _STATUS.get(rollout.finish_reason, "COMPLETED"))
    out = []
    for k, seg in enumerate(rollout.segments):
        first = next((i for i, m in enumerate(seg.loss_mask) if m), len(seg.input_ids))
        if first == 0:
            raise ValueError(f"segment {k} starts with a trainable token: slime needs a prompt before the response")
        s = copy.copy(sample)
        s.tokens = list(seg.input_ids)
        s.response_length = len(seg.input_ids) - first
        s.loss_mask = [int(bool(m)) for m in seg.loss_mask[first:]]
        s.rollout_log_probs = [float(x) for x in seg.logprobs[first:]]
        s.response = decode(s.tokens[first:]) if decode is not None else ""
        s.reward, s.status, s.rollout_id = float(rollout.reward), status, rid
        s.metadata = dict(sample.metadata or {}, round_number=k,
                          compaction={"kind": seg.kind, "segments": len(rollout.segments),
                                      "finish_reason": rollout.finish_reason, "compactions": rollout.compactions})
        out.append(s)
    return out


def samples_from_calls(calls, reward, sample, *, rollout_id=None, decode=None, **kwargs) -> list:
    """`samples_from_rollout(rollout_from_calls(calls, reward, **kwargs), sample)`: a slime harness's call logs
    (prompt ids, completion ids, log-probs per LLM call; docs/calls.md) as segment Samples that
    `compute_advantages` links, instead of one Sample per segment each with the full reward and no order."""
    return samples_from_rollout(rollout_from_calls(calls, reward, **kwargs), sample, rollout_id=rollout_id,
                                decode=decode)


@functools.lru_cache(maxsize=8)
def _chat(tokenizer_key):
    path, hf = tokenizer_key
    if path is not None:
        tok = load_object(path, "compaction_tokenizer")()
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(hf, trust_remote_code=True)
    return ChatFormat(tok)


_ENGINES = {}


def _engine(args, sampling_params):
    host = str(get(args, "sglang_router_ip", ""))
    if not host or get(args, "sglang_router_port") is None:
        raise ValueError("args.sglang_router_ip / sglang_router_port are not set: slime's router address is "
                         "needed (slime sets them when it starts the router)")
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    url = f"http://{host}:{int(args.sglang_router_port)}"
    skip = {"max_new_tokens", "temperature", "top_p", "stop_token_ids", "sampling_seed"}
    extra = {k: v for k, v in sampling_params.items() if k not in skip}
    key = (url, repr(sorted(extra.items())))
    if key not in _ENGINES:
        _ENGINES[key] = SGLangEngine(url, sampling_params=extra)
    return _ENGINES[key]


def slime_stop_token_ids(args, sampling_params) -> tuple:
    """The stop tokens slime asks for: `sampling_params["stop_token_ids"]` (what slime's own generate sends to
    SGLang: --rollout-stop-token-ids, or an eval dataset's own `stop_token_ids`), else
    `args.rollout_stop_token_ids` (sampling parameters without the key, e.g. a custom rollout function's)."""
    ids = sampling_params.get("stop_token_ids")
    if ids is None:
        ids = get(args, "rollout_stop_token_ids")
    if ids is None:
        return ()
    if isinstance(ids, (int, str)):  # slime's flag takes "a list of integers or a single integer"
        ids = [ids]
    try:
        return tuple(sorted({int(t) for t in ids}))
    except (TypeError, ValueError):
        raise ValueError(f"slime's stop_token_ids must be token ids (integers), got {ids!r}") from None


def rollout_config(args, sampling_params) -> RolloutConfig:
    """RolloutConfig from the YAML key `compaction_rollout` (a dict of RolloutConfig fields); temperature and
    top_p default to slime's (--rollout-temperature, --rollout-top-p), the response cap to
    --rollout-max-response-len (sampling_params["max_new_tokens"]), the budget to --rollout-max-context-len.
    Its `stop_token_ids` are those of `compaction_rollout` and slime's (`slime_stop_token_ids`: the loop stops a
    response, and strips the stop token from the action and the summary, at either, as at the chat format's
    end of turn)."""
    fields = get(args, "compaction_rollout", {})
    if not isinstance(fields, dict):
        raise TypeError(f"compaction_rollout must be a mapping of RolloutConfig fields, got {type(fields).__name__}")
    base = {}
    for k, v in (("temperature", sampling_params.get("temperature")), ("top_p", sampling_params.get("top_p")),
                 ("max_response_tokens", sampling_params.get("max_new_tokens")),
                 ("budget", get(args, "rollout_max_context_len"))):
        if v is not None:
            base[k] = v
    base.update(fields)
    own = tuple(base.get("stop_token_ids") or ())
    base["stop_token_ids"] = own + tuple(t for t in slime_stop_token_ids(args, sampling_params) if t not in own)
    try:
        return RolloutConfig(**base)
    except (TypeError, ValueError) as e:
        raise ValueError(f"compaction_rollout: {e}") from None


async def generate(args, sample, sampling_params, evaluation=False):
    """slime's --custom-generate-function-path target: one compaction episode -> one Sample per segment.

    Options (YAML keys of --custom-config-path, docs/slime.md): `compaction_env` (required: dotted path of
    `make_env(args, sample)` returning an environment with reset(seed) / step(action)), `compaction_rollout`,
    `compaction_tokenizer` (dotted path of a function returning the tokenizer; default: the tokenizer of
    --hf-checkpoint). The episode's reset seed is `sample.metadata["seed"]`, else `sample.index`. slime's stop
    tokens (`sampling_params["stop_token_ids"]`, else --rollout-stop-token-ids) end a response as the chat
    format's end of turn does, and `sampling_params` other than the loop's own (stop strings, top_k, ...) go
    to the router with every request.

    Returns the segment Samples (evaluation: the last one only, carrying the episode's reward); `sample` with
    status ABORTED when slime aborted a request.
    """
    Sample = _sample_class()
    if get(args, "partial_rollout", False):
        raise ValueError("--partial-rollout is not supported by compactionrl_fast.integrations.slime.generate: "
                         "an episode runs to its end in one call; drop --partial-rollout")
    env_path = get(args, "compaction_env")
    if env_path is None:
        raise ValueError("compaction_env is not set: name the environment factory make_env(args, sample) in the "
                         "--custom-config-path YAML (compaction_env: my_pkg.envs.make_env)")
    env = load_object(env_path, "compaction_env")(args, sample)
    config = rollout_config(args, sampling_params)
    seed = (sample.metadata or {}).get("seed", sample.index)
    if config.seed is not None:  # one stream per prompt: the loop seeds by episode, and each call runs one
        config = config.replace(seed=config.seed * 1_000_003 + int(sample.index or 0))
    tok_key = (get(args, "compaction_tokenizer"), get(args, "hf_checkpoint"))
    if tok_key == (None, None):
        raise ValueError("no tokenizer: set --hf-checkpoint, or compaction_tokenizer (a function returning one)")
    chat = _chat(tok_key)
    try:
        [rollout] = await arun_episodes(_engine(args, sampling_params), [env], chat.tokenizer, config,
                                        seeds=[seed], chat=chat)
    except RolloutAborted:
        sample.status = Sample.Status.ABORTED
        return sample
    samples = samples_from_rollout(rollout, sample, decode=chat.decode)
    if not samples:  # the environment failed at reset: nothing was generated
        sample.status, sample.reward = Sample.Status.FAILED, float(rollout.reward)
        sample.response_length, sample.loss_mask, sample.rollout_log_probs = 0, [], []
        if sample.rollout_id is None:
            sample.rollout_id = sample.index
        sample.metadata = dict(sample.metadata or {}, round_number=0, compaction={
            "kind": None, "segments": 0, "finish_reason": rollout.finish_reason, "compactions": 0})
        # a list like every other episode's: slime flattens the step's groups by the first one's shape
        samples = [sample]
    return samples[-1] if evaluation else samples
