"""The bytes each token id of a vocabulary stands for, as a grammar engine matches them.

A grammar constrains bytes; a model emits token ids. `token_bytes` maps every id of the
model's logits to the bytes the token adds to the output text, or to None for an id that
must never be emitted where the output is constrained: control tokens (added tokens marked
special, EOS included: it ends the output, it adds no text), unused vocabulary slots
(llama.cpp's converters fill padded vocabularies with `[PAD<id>]` tokens) and ids past the
tokenizer's vocabulary (the model's logits may be wider).

How a token's string becomes bytes depends on the vocabulary's kind, read from the
backend's decoder:
- byte-level BPE (GPT-2, Llama 3, Qwen): each character of the token stands for one byte
  (GPT-2's printable byte alphabet, e.g. "Ġ" for a space);
- SentencePiece style (Llama 2, Mistral, Gemma): "▁" stands for a space and byte-fallback
  tokens `<0x0A>` for one byte each; other characters are their UTF-8.
Added tokens that are not special (Qwen2.5's `<tool_call>`) are their content's UTF-8.
"""

from __future__ import annotations

import functools
import json
import re

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from specserve.models.tokenizer import Tokenizer

BYTE_LEVEL, SENTENCEPIECE = "byte_level", "sentencepiece"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes of ids 0..vocab_size-1 (None: never emitted under a grammar, see the module
    doc). `vocab_size` is the model's logits width, at least the tokenizer's vocabulary."""
    backend = tokenizer.backend
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size} tokens)")
    decode = _byte_level_piece if vocabulary_kind(backend) == BYTE_LEVEL else _sentencepiece_piece
    pieces: list[str | None] = [None] * tokenizer.vocab_size
    for piece, i in backend.get_vocab(with_added_tokens=False).items():
        pieces[i] = piece
    out = [None if piece is None or _is_unused(piece, i) else decode(piece)
           for i, piece in enumerate(pieces)]
    for i, token in backend.get_added_tokens_decoder().items():
        out[i] = None if token.special else token.content.encode("utf-8")
    for i in tokenizer.eos_token_ids:
        if i < len(out):
            out[i] = None
    return out + [None] * (vocab_size - tokenizer.vocab_size)


def _is_unused(piece: str, i: int) -> bool:
    return piece.startswith("[PAD") and piece == f"[PAD{i}]"


def vocabulary_kind(backend: HFTokenizer) -> str:
    """BYTE_LEVEL or SENTENCEPIECE, from the types of the backend's decoder (and its parts)."""
    decoder = backend.decoder
    types = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else set()
    if "ByteLevel" in types:
        return BYTE_LEVEL
    if types & {"ByteFallback", "Metaspace", "Replace"}:
        return SENTENCEPIECE
    raise ValueError(f"cannot tell how this tokenizer's tokens map to bytes (decoder types "
                     f"{sorted(types) or 'none'}); byte-level BPE and SentencePiece-style "
                     f"vocabularies are supported")


def _decoder_types(state: dict) -> set[str]:
    types = {state.get("type", "")}
    for part in state.get("decoders") or []:
        types |= _decoder_types(part)
    return types


@functools.cache
def _byte_level_table() -> dict[int, str]:
    """A `str.translate` table from GPT-2's byte alphabet to Latin-1 (one character per byte):
    printable Latin-1 bytes stand for themselves, the other 68 bytes, in order, for the
    characters from U+0100 on; the raw characters of those 68 bytes are not in the alphabet
    and map to U+FFFF, which Latin-1 cannot encode."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE]
    others = [b for b in range(256) if b not in printable]
    table = {256 + k: chr(b) for k, b in enumerate(others)} | {b: "\uffff" for b in others}
    assert {chr(c) for c in table if c >= 256} | {chr(b) for b in printable} \
        == set(pre_tokenizers.ByteLevel.alphabet())
    return table


def _byte_level_piece(piece: str) -> bytes | None:
    """None for a piece outside the byte alphabet: no bytes can be told for it."""
    try:
        return piece.translate(_byte_level_table()).encode("latin-1")
    except UnicodeEncodeError:
        return None


def _sentencepiece_piece(piece: str) -> bytes:
    if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
