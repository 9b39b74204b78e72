"""A word-level tokenizer with a chat template, built locally with `tokenizers` (no downloads).

Used by the built-in memory task: every word of its small vocabulary is one token, so token counts are
easy to reason about (a turn of "digit 3 7 + 15 fillers" is a known number of tokens).
"""
from __future__ import annotations

SPECIAL_TOKENS = ["<pad>", "<unk>", "<eos>", "<system>", "<user>", "<assistant>"]

# One message: "<role> content <eos>"; the generation prompt is "<assistant>". The assistant's own
# "<eos>" is the stop token, so the model writes it and it is trained.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def word_tokenizer(words, *, chat_template: str = CHAT_TEMPLATE):
    """A `transformers.PreTrainedTokenizerFast` over SPECIAL_TOKENS + `words` (whitespace-split words).

    Unknown words map to "<unk>"; decoding joins words with spaces. Token ids are stable: specials first
    (pad=0, unk=1, eos=2, system=3, user=4, assistant=5), then `words` in the given order.

    Example:
        >>> tok = word_tokenizer(["next", "digit", "7"])
        >>> tok.encode("next digit 7 <eos>", add_special_tokens=False)
        [6, 7, 8, 2]
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {}
    for w in list(SPECIAL_TOKENS) + list(words):
        if " " in w or not w:
            raise ValueError(f"words must be non-empty and contain no spaces, got {w!r}")
        vocab.setdefault(w, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                  additional_special_tokens=SPECIAL_TOKENS[3:])
    tok.chat_template = chat_template
    return tok
