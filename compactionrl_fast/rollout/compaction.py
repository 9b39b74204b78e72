"""Compaction: the trigger, the state rebuild, and the chat-format pieces the loop builds contexts from.

The loop never renders a whole conversation: it concatenates token pieces. The pieces come from the
tokenizer's chat template (rendered once with marker contents and cut at the markers), so the context is
what the template would produce, while the model's own tokens are kept exactly as sampled.

A context is `head + turn_1 + ... + turn_t`, where head = system message + first user message (the task,
or after a compaction the resume message), and turn_i = generation prompt + response + end of the
assistant message + the observation as a user message. Every turn is self-contained, so the last k turns
can be copied into a rebuilt context as they are.
"""
from __future__ import annotations

_MARK = ("QQSYSQQ", "QQUSERQQ", "QQASSISTANTQQ", "QQOBSQQ", "QQOBS2QQ", "QQSUMMARYQQ")


def needs_compaction(context_len: int, budget: int, threshold: int) -> bool:
    """The trigger: C - |h_t| < T_comp."""
    return budget - context_len < threshold


def rebuild(head_ids: list, turns: list, keep: int, budget: int, threshold: int):
    """h' = head + last k turns, k lowered from `keep` (down to 0) until h' leaves `threshold` tokens free
    (the trigger would not fire at once). Returns (ids, k). With k = 0 h' is returned even if too long.

    Args:
        head_ids: system + resume message tokens. turns: list of per-turn token lists, oldest first.
    """
    k = min(keep, len(turns))
    while k > 0 and needs_compaction(len(head_ids) + sum(len(t) for t in turns[len(turns) - k:]), budget, threshold):
        k -= 1
    ids = list(head_ids)
    for t in turns[len(turns) - k:]:
        ids.extend(t)
    return ids, k


def _cut(text: str, mark: str):
    i = text.find(mark)
    if i < 0 or text.find(mark, i + 1) >= 0:
        raise ValueError(f"chat template: marker {mark!r} must appear exactly once in {text!r}")
    return text[:i], text[i + len(mark):]


class ChatFormat:
    """Token pieces of a chat format, derived from `tokenizer.chat_template` (or a plain fallback).

    The template must be prefix-stable (rendering one more message only appends text), as the common
    templates are; otherwise a ValueError says so.

    Attributes (token id lists): gen_prompt (assistant header), assistant_end (closes an assistant
    message; its first token is the stop token when the template ends assistant messages with EOS),
    user_pre / user_post (wrap a user message).
    """

    def __init__(self, tokenizer, system_role: str = "system"):
        self.tokenizer = tokenizer
        self.system_role = system_role
        self._fast = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._heads = {}  # (system, user) -> rendered text (task and resume texts repeat across rollouts)
        eos = tokenizer.eos_token
        if getattr(tokenizer, "chat_template", None):
            ms, mu, ma, mo, mo2, _ = _MARK
            r0 = self._render([("system", ms), ("user", mu)])
            r1 = self._render([("system", ms), ("user", mu), ("assistant", ma)])
            r2 = self._render([("system", ms), ("user", mu), ("assistant", ma), ("user", mo)])
            r3 = self._render([("system", ms), ("user", mu), ("assistant", ma), ("user", mo), ("user", mo2)])
            g0 = self._render([("system", ms), ("user", mu)], gen=True)
            for a, b in ((r0, r1), (r1, r2), (r2, r3), (r0, g0)):
                if not b.startswith(a):
                    raise ValueError("the tokenizer's chat template is not prefix-stable; pass a tokenizer whose "
                                     "template only appends text per message")
            self._head_text = r0  # rendered again per head with real contents
            gen = g0[len(r0):]
            _, a_post = _cut(r1[len(r0):], ma)
            u_pre, u_post = _cut(r2[len(r1):], mo)
            if r3[len(r2):] != u_pre + mo2 + u_post:
                raise ValueError("the tokenizer's chat template wraps consecutive user messages differently")
        else:
            gen, a_post, u_pre, u_post = "assistant: ", (eos or "") + "\n", "user: ", "\n"
            self._head_text = None
        self.gen_prompt = self.encode(gen)
        self.assistant_end = self.encode(a_post)
        self.user_pre = self.encode(u_pre)
        self.user_post = self.encode(u_post)
        # the model ends its message by sampling EOS, or the special token that closes assistant messages
        stops = {tokenizer.eos_token_id} - {None}
        if self.assistant_end and self.assistant_end[0] in set(tokenizer.all_special_ids):
            stops.add(self.assistant_end[0])
        self.stop_token_ids = tuple(sorted(stops))

    def _render(self, msgs, gen=False):
        return self.tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in msgs], tokenize=False,
                                                  add_generation_prompt=gen)

    def encode(self, text: str) -> list:
        if not text:
            return []
        if self._fast is not None:  # the Rust tokenizer directly: same ids, far less overhead per call
            return self._fast.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def head(self, system: str, user: str, splice: list | None = None, mark: str = _MARK[5]) -> list:
        """System message + first user message; with `splice`, the token ids `splice` replace `mark` in
        `user` (used to put the summary's own tokens into the resume message)."""
        text = self._heads.get((system, user))
        if text is None:
            if self._head_text is not None:
                text = self._render([(self.system_role, system), ("user", user)])
            else:
                bos = self.tokenizer.bos_token or ""
                text = f"{bos}system: {system}\nuser: {user}\n"
            if len(self._heads) < 4096:
                self._heads[(system, user)] = text
        if splice is None:
            return self.encode(text)
        a, b = _cut(text, mark)
        return self.encode(a) + list(splice) + self.encode(b)

    def resume_head(self, system: str, task: str, summary_ids: list, template: str) -> list:
        """s + u_resume(S): the rebuilt context's head with the summary's tokens spliced in."""
        user = template.replace("{task}", task).replace("{summary}", _MARK[5])
        return self.head(system, user, splice=summary_ids)

    def close_response(self, response_ids: list) -> list:
        """Tokens that close an assistant message after `response_ids` (its end minus a sampled stop)."""
        if response_ids and self.assistant_end and response_ids[-1] == self.assistant_end[0]:
            return self.assistant_end[1:]
        return list(self.assistant_end)

    def user_message(self, content_ids: list) -> list:
        return self.user_pre + list(content_ids) + self.user_post
