"""SentencePiece vocabularies of GGUF files (`tokenizer.ggml.model == "llama"`: Gemma, Llama 2,
Mistral, Phi-3), tokenized as llama.cpp's `llm_tokenizer_spm` does, on the `tokenizers` library.

llama.cpp's algorithm: each stretch of text between special tokens gets a space in front
where `tokenizer.ggml.add_space_prefix` (default true; Gemma's files say false), its spaces
become `▁`, and from single characters on, the adjacent pair whose concatenation is the
highest-scoring token merges first; a character that is no token becomes the byte-fallback
tokens `<0x00>`..`<0xFF>` of its UTF-8 bytes. Here that is a BPE model whose merges are every
split of a token into two tokens, ranked by the token's score (then its id), with byte
fallback, behind a normalizer that prepends `▁` and replaces spaces. The normalizer runs on
each stretch between added tokens, which is where llama.cpp puts its prefix. Control and
unknown tokens are special added tokens, user-defined ones plain added tokens (matched whole in
the raw text, as llama.cpp does even when special tokens are not parsed).

Where this departs from llama.cpp: among pairs of equal score llama.cpp merges the leftmost,
a BPE model the one ranked first (a vocabulary whose scores are distinct, as trained
SentencePiece models are, is unaffected); no merge ever yields a control, unknown or byte token
(llama.cpp would turn the text "<" "s>" into the control token `<s>`; SentencePiece does not).

`PieceDecoder` decodes as llama.cpp's detokenizer: each token's bytes (`▁` a space, a byte
token its byte, control and unknown tokens nothing unless asked for, unused tokens nothing)
read as UTF-8, U+FFFD for each invalid sequence, and where add_space_prefix one leading space
dropped from the text (the one encoding put there), counted after skipped special tokens as
Hugging Face's decoder does (llama.cpp keeps it after a BOS).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # ▁
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_NOT_FROM_TEXT = (UNKNOWN, CONTROL, BYTE)  # token types no merge may produce
# end-of-generation tokens llama.cpp recognizes by their text (llama-vocab.cpp), and makes
# control tokens whatever type the file gives them
EOG_TEXTS = frozenset({"<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>",
                       "</s>", "<|eom_id|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
                       "<end_of_utterance>", "<eos>"})


@dataclass(frozen=True)
class PieceDecoder:
    """Token ids to text, as llama.cpp's detokenizer (see the module docstring)."""

    pieces: tuple[bytes, ...]  # [vocab]: each token's bytes
    special: frozenset[int]  # control and unknown tokens: text only when not skipped
    strip_space: bool  # drop the leading space add_space_prefix put there

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        pieces, special, n = self.pieces, self.special, len(self.pieces)
        skip = special if skip_special_tokens else ()
        data = b"".join([pieces[i] for i in ids if 0 <= i < n and i not in skip])
        text = data.decode("utf-8", errors="replace")
        return text[1:] if self.strip_space and text.startswith(" ") else text


@dataclass(frozen=True)
class SpmVocab:
    """What `Tokenizer` is built from."""

    backend: HFTokenizer
    decoder: PieceDecoder
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    add_bos: bool
    add_eos_id: int | None  # the EOS where the file says add_eos_token
    special_tokens: dict[str, str]  # bos_token / eos_token / unk_token / pad_token as text


def from_gguf(meta: dict) -> SpmVocab:
    """The SentencePiece vocabulary of GGUF `tokenizer.*` metadata, with llama.cpp's defaults
    (BOS 1, EOS 2, UNK 0, add_bos true, add_eos false, add_space_prefix true)."""
    tokens = tuple(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    scores = tuple(float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * n)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * n
    if len(scores) != n or len(types) != n:
        raise ValueError(f"GGUF tokenizer: {n} tokens but {len(scores)} scores and "
                         f"{len(types)} token types")
    types = tuple(CONTROL if t in EOG_TEXTS else int(ty) for t, ty in zip(tokens, types))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))

    def token_id(key: str, default: int | None) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}", default)
        return int(value) if value is not None and 0 <= int(value) < n else None

    unk = token_id("unknown_token_id", 0)
    backend, decoder = _build(tokens, scores, types, prefix, unk)
    ids = {"bos_token": token_id("bos_token_id", 1), "eos_token": token_id("eos_token_id", 2),
           "unk_token": unk, "pad_token": token_id("padding_token_id", None)}
    eos = {i for i in (ids["eos_token"], token_id("eot_token_id", None),
                       token_id("eom_token_id", None)) if i is not None}
    eos |= {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    return SpmVocab(backend, decoder, ids["bos_token"], frozenset(eos),
                    bool(meta.get("tokenizer.ggml.add_bos_token", True)),
                    ids["eos_token"] if add_eos else None,
                    {name: tokens[i] for name, i in ids.items() if i is not None})


@functools.lru_cache(maxsize=4)  # the two models of a pair carry the same vocabulary
def _build(tokens: tuple[str, ...], scores: tuple[float, ...], types: tuple[int, ...],
           prefix: bool, unk: int | None) -> tuple[HFTokenizer, PieceDecoder]:
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated text: its last id, as llama.cpp
    model = models.BPE(vocab, merges(tokens, scores, types, vocab), byte_fallback=True,
                       fuse_unk=True, unk_token=tokens[unk] if unk is not None else None)
    backend = HFTokenizer(model)
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) \
        if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return backend, PieceDecoder(tuple(_piece(t, ty) for t, ty in zip(tokens, types)),
                                 frozenset(i for i, ty in enumerate(types)
                                           if ty in (CONTROL, UNKNOWN)), prefix)


def merges(tokens, scores, types, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a mergeable token into two tokens, best-scored token first (ties: the
    lower id, then the shorter left half)."""
    ranked = []
    for i, token in enumerate(tokens):
        if types[i] in _NOT_FROM_TEXT or len(token) < 2 or vocab[token] != i:
            continue
        score = -scores[i]
        for k in range(1, len(token)):
            left = token[:k]
            if left in vocab:
                right = token[k:]
                if right in vocab:
                    ranked.append((score, i, k, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _piece(token: str, kind: int) -> bytes:
    """The bytes a token stands for in text (llama.cpp's `token_to_piece`): a normal token's
    text with `▁` as spaces, a byte token's byte, a user-defined, control or unknown token's
    text as it is (the latter two shown only when asked for), any other type nothing."""
    if kind == BYTE:
        if _BYTE_TOKEN.fullmatch(token) is None:
            raise ValueError(f"GGUF tokenizer: byte token {token!r} is not <0xXX>")
        return bytes([int(token[3:5], 16)])
    if kind == NORMAL:
        return token.replace(SPACE, " ").encode()
    return token.encode() if kind in (USER_DEFINED, CONTROL, UNKNOWN) else b""
