"""A cheaper draft model: its vocabulary head computes only the most frequent tokens.

A draft step of a small model reads its vocabulary head (vocab × hidden weights) every token:
for a 150k-token vocabulary that is a large share of the step. A draft that only proposes
tokens it can score does not need the rest: `restricted_head` is a head over
the `keep` lowest token ids plus the tokenizer's added tokens (special tokens: end of turn,
end of text). BPE vocabularies number their merges in the order they were learned, most
frequent pairs first, so the lowest ids are the most frequent tokens (the byte tokens and
common words); the rest get logit −inf, so the draft never proposes them.

Lossless all the same: the verifier judges each draft against the distribution it was
sampled from, and that distribution is the restricted one (zero outside the kept set); where
the target wants a token the draft cannot propose, the residual max(0, p − q) gives it.
"""

from __future__ import annotations

import dataclasses

import torch

from specserve.models.transformer import Linear
from specserve.weights.quant import KIND_R8, NativeLinear, NativeWeights

TILE = 16  # outputs per tile of the native 4- and 6-bit layouts


class RestrictedHead:
    """Logits `[rows, vocab]` from a head over the first `keep` ids and the `extra` ids; −inf
    elsewhere."""

    def __init__(self, first: object, keep: int, extra_ids: torch.Tensor, extra: object,
                 vocab: int) -> None:
        self.first, self.extra, self.vocab = first, extra, vocab
        self.extra_ids = extra_ids  # [n_extra] int64
        self.keep = keep  # `first`'s outputs (a dense `Linear` has no out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [rows, hidden]
        out = flat.new_full((flat.shape[0], self.vocab), float("-inf"), dtype=torch.float32)
        out[:, :self.keep] = self.first(flat).float()
        if self.extra_ids.numel():
            out[:, self.extra_ids] = self.extra(flat).float()
        return out.reshape(*x.shape[:-1], self.vocab)


def restricted_head(model, keep: int, extra_ids: list[int]) -> RestrictedHead | None:
    """A head for `model` (a Transformer) over ids 0..keep−1 (rounded up to a tile) and
    `extra_ids`, sharing the model's weights (the model is not changed: the draft's runner
    passes the head to its passes); None when that covers the vocabulary or the head's
    format is not one this slices (PyTorch's packed fallbacks; a native head of several
    parts)."""
    vocab = model.cfg.vocab_size
    keep = min(vocab, -(-keep // TILE) * TILE)
    extra = sorted({i for i in extra_ids if keep <= i < vocab})
    head = model.lm_head
    if keep + len(extra) >= vocab or not isinstance(head, (NativeLinear, Linear)):
        return None
    if isinstance(head, NativeLinear) and (len(head.parts) != 1
                                           or not isinstance(head.parts[0], NativeWeights)):
        return None
    rows = torch.tensor(extra, dtype=torch.long)
    return RestrictedHead(_first_rows(head, keep), keep, rows, _float_rows(head, rows), vocab)


def _first_rows(head, keep: int):
    """The head's first `keep` outputs, in its own format (views of its weights)."""
    bias = head.bias[:keep] if head.bias is not None else None
    if isinstance(head, NativeLinear):
        return NativeLinear.from_weights(head.w.rows(0, keep), bias, act_block=head.act_block)
    return Linear(head.weight[:keep], bias)


def _float_rows(head, rows: torch.Tensor) -> Linear:
    """A float head over the `rows` ids: the head's own rows, dequantized to float32 (a native
    head's activations are float32), or in the dense head's dtype (its activations')."""
    bias = head.bias[rows] if head.bias is not None else None
    if not isinstance(head, NativeLinear):
        return Linear(head.weight[rows].contiguous(), bias)
    weight = _dequantized_rows(head.w, rows)
    return Linear(weight.float().contiguous(), bias.float() if bias is not None else None)


def _dequantized_rows(w: NativeWeights, rows: torch.Tensor) -> torch.Tensor:
    """[len(rows), k] float32: rows of `w` dequantized, reading only the tiles holding them."""
    if w.kind == KIND_R8:
        part = dataclasses.replace(w, out_features=len(rows), qs=w.qs[rows], sc=w.sc[rows],
                                   dsup=w.dsup[rows])
        return part.dequantize()
    tiles = torch.unique(rows // TILE)  # [n_tiles] ascending
    pick = lambda a: a[tiles] if a is not None else None  # noqa: E731
    part = dataclasses.replace(w, out_features=len(tiles) * TILE, qs=pick(w.qs), sc=pick(w.sc),
                               dsup=pick(w.dsup), mins=pick(w.mins), dmin=pick(w.dmin),
                               qh=pick(w.qh))
    where = torch.searchsorted(tiles, rows // TILE) * TILE + rows % TILE  # [len(rows)]
    return part.dequantize()[where]
