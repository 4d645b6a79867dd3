"""Tiny vocabularies for the grammar tests, built with the `tokenizers` library in
milliseconds: a byte-level BPE (the 256 byte tokens, merges learned from a few JSON lines,
Qwen-style added tokens, llama.cpp-style unused `[PAD<id>]` slots) and a SentencePiece-style
one (`▁` for a space, `<0x0A>` byte-fallback tokens)."""

from __future__ import annotations

import functools
import json

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from specserve.models.tokenizer import Tokenizer

CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "search", "arguments": {"query": "best pizza in Naples", "limit": 5}}',
    '{"title": "Dune", "year": 1965, "tags": ["scifi", "classic"], "ok": true, "n": null}',
    "Sure, let me check the weather for you. The answer is 42.",
]
MERGES = 160  # learned tokens past the 256 bytes
UNUSED = 3  # [PAD<id>] slots after the learned tokens
LOGITS_PAD = 29  # the model's logits are wider than the tokenizer by this many ids
SPECIALS = ["<|endoftext|>", "<|im_end|>"]  # control tokens; the second is EOS
TOOL_TAGS = ["<tool_call>", "</tool_call>"]  # added, not special (as in Qwen2.5)


@functools.cache
def byte_level() -> Tokenizer:
    """The byte-level BPE: bytes, merges, unused slots, then the added tokens."""
    trainer = trainers.BpeTrainer(vocab_size=256 + MERGES, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    learner = HFTokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(learner.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab |= {f"[PAD{len(vocab) + k}]": len(vocab) + k for k in range(UNUSED)}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = HFTokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TAGS])
    eos = backend.token_to_id(SPECIALS[1])
    return Tokenizer(backend, frozenset({eos}), None, False, None, {"eos_token": SPECIALS[1]})


def logits_width(tokenizer: Tokenizer) -> int:
    return tokenizer.vocab_size + LOGITS_PAD


def sentencepiece_style() -> Tokenizer:
    """A SentencePiece-style vocabulary: `<unk>`, `<s>`, `</s>`, 256 byte-fallback tokens,
    then a few pieces with the `▁` space marker."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "a", "b", "▁a", "▁ab", "é", "{", "}", '"', ":"]
    backend = HFTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True,
                                     unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t in ["<unk>", "<s>", "</s>"]])
    return Tokenizer(backend, frozenset({2}), 1, True, None, {"eos_token": "</s>"})
