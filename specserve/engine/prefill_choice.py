"""Which prefill path a model's prompt rows take (`EngineConfig.prefill_path`), chosen once at
start-up on the machine itself, never by CPU name.

- "native": every row on the int4 kernels and the native attention (nothing made, nothing
  timed);
- "onednn": every projection and attention of prompt rows on oneDNN (forced: tests and
  benchmarks, on any machine);
- "auto" (the default): both paths timed on the model's own shapes (layer 0's int4
  projections against bfloat16 ones of the same shapes; the native attention against
  `prefill_attention`) at the chunk sizes the engine uses, and each part takes the faster.
  A projection takes one path for every prompt row: the one faster over the chunk sizes
  timed together (not per row count: a prompt's keys must not depend on how it was cut into
  chunks). Attention takes oneDNN from a position on, where it was faster at every context
  timed from there up. oneDNN must be faster by `MARGIN` (timings of close paths flip with
  noise). Where oneDNN is slower at everything, nothing changes and no dense weights are
  made; likewise where other work on the machine disturbed the timed runs (a busy machine's
  timings are noise: measured here at load 12 on 2 cores, they took oneDNN for projections it
  loses by 1.5x when quiet); `prefill_path="onednn"` forces it. The choice is made once per
  loaded model: every later engine over the same model in this process takes it as it stands
  (timings are noisy where two paths are close, and engines over one model, e.g. target-only
  and speculative, must prefill a prompt through the same path).

The dense weights of the projections chosen (bfloat16, from the file's own dequantization)
cost 2 bytes per weight beside the int4 ones. Why: docs/design.md, "Prefill on oneDNN".
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from functools import partial

import torch

from specserve.models.attention import ragged_attention
from specserve.models.prefill import (NATIVE, ONEDNN, PROJECTIONS, DenseProjection,
                                      PrefillChoice, attention_masks, prefill_attention)
from specserve.speculative.calibration import CALIBRATION_PATIENCE_S, settled_medians
from specserve.weights.quant import NativeLinear

log = logging.getLogger("specserve.engine")
PREFILL_PATHS = ("auto", "onednn", "native")
ATTENTION_CONTEXTS = (1024, 8192, 16384)  # contexts the attention paths are timed at
REPEATS = 3
MARGIN = 0.9  # oneDNN's time must be under this share of the native one to take a part
_CHOSEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its auto choice


@dataclass(frozen=True, slots=True)
class Timing:
    """Median seconds of one part of a prefill pass on each path: `part` a projection or
    "attention", `rows` the rows timed, `context` (attention) the position after the last."""

    part: str
    rows: int
    native_s: float
    onednn_s: float
    context: int = 0


def decide(timings: list[Timing], disturbed: bool = False) -> PrefillChoice:
    """The choice the timings give (see the module doc): a projection on oneDNN where its
    total over the row counts timed is lower there by `MARGIN`; attention from the first row
    of the smallest context from which oneDNN was faster by `MARGIN` at every context timed;
    nothing on oneDNN where the timings were `disturbed`."""
    if disturbed:
        return PrefillChoice((), None, tuple(timings), disturbed=True)
    projections = tuple(p for p in PROJECTIONS if _faster([t for t in timings if t.part == p]))
    attention = sorted((t for t in timings if t.part == "attention"), key=lambda t: t.context)
    start = None
    for i in range(len(attention)):
        if all(t.onednn_s < MARGIN * t.native_s for t in attention[i:]):
            start = 0 if i == 0 else attention[i].context - attention[i].rows
            break
    return PrefillChoice(projections, start, tuple(timings))


def _faster(timings: list[Timing]) -> bool:
    return bool(timings) and \
        sum(t.onednn_s for t in timings) < MARGIN * sum(t.native_s for t in timings)


def choose(model, option: str, chunk_rows: int, max_len: int, kv_dtype: torch.dtype,
           patience_s: float = CALIBRATION_PATIENCE_S) -> PrefillChoice:
    """The prefill choice `option` gives `model` (a `Transformer`) here; "auto" times the
    paths at `chunk_rows` (the engine's step budget) and a quarter of it, attention at the
    `ATTENTION_CONTEXTS` up to `max_len`, with pools of `kv_dtype`, the first time it is asked
    for `model`, and returns that choice every later time. A model without the native glue
    and int4 projections has no prefill path: "native" for it, and "onednn" is an error."""
    if option not in PREFILL_PATHS:
        raise ValueError(f"prefill_path must be one of {PREFILL_PATHS}, got {option!r}")
    if option == "native":
        return NATIVE
    if not has_prefill_path(model):
        if option == "onednn":
            raise ValueError("prefill_path='onednn' needs a quantized model on the native "
                             "kernels (weights int4 or int8, with their source file)")
        return NATIVE
    if option == "onednn":
        return ONEDNN
    chosen = _CHOSEN.get(model)
    if chosen is None:
        timings, disturbed = measure(model, chunk_rows, max_len, kv_dtype, patience_s)
        if disturbed:
            log.warning("other work on this machine disturbed the prefill paths' timed runs: "
                        "prefill stays native (prefill_path='onednn' forces oneDNN)")
        chosen = _CHOSEN[model] = decide(timings, disturbed)
    return chosen


def has_prefill_path(model) -> bool:
    """Whether `model`'s passes run on the native glue with int4/int8 projections that keep
    a dense source (what the prefill path replaces)."""
    probe = torch.empty(0, dtype=getattr(model, "act_dtype", torch.bfloat16))
    native = getattr(model, "_native_layers", None)
    return (getattr(model, "dense_weights", None) is not None and native is not None
            and native(probe) and isinstance(model.layers[0].qkv, NativeLinear))


def measure(model, chunk_rows: int, max_len: int, kv_dtype: torch.dtype,
            patience_s: float = CALIBRATION_PATIENCE_S) -> tuple[list[Timing], bool]:
    """Both paths of every projection and of attention, timed in turn round after round
    (`settled_medians`); returns the timings and whether they stayed disturbed."""
    g = torch.Generator().manual_seed(0)
    rows_timed = sorted({chunk_rows, max(1, chunk_rows // 4)})
    timers, parts = {}, {}
    layer = model.layers[0]
    for name in PROJECTIONS:
        native = getattr(layer, name)
        dense = DenseProjection(torch.randn(native.out_features, native.in_features,
                                            generator=g) * 0.02, native.bias)
        for rows in rows_timed:
            x = torch.randn(rows, native.in_features, generator=g)
            out = torch.empty(rows, native.out_features)
            timers[(name, rows, "native")] = partial(_timed, native.into, x, out)
            timers[(name, rows, "onednn")] = partial(_timed, lambda d, a, o: o.copy_(d(a)),
                                                     dense, x, out)
            parts[(name, rows)] = 0
    contexts = [c for c in ATTENTION_CONTEXTS if c <= max_len] or [max_len]
    for context in contexts:
        rows = min(chunk_rows, context)
        native_run, onednn_run = attention_runs(model.cfg, rows, context, kv_dtype, g)
        timers[("attention", rows, "native", context)] = partial(_timed, native_run)
        timers[("attention", rows, "onednn", context)] = partial(_timed, onednn_run)
    for run in timers.values():  # warm-up: first calls pay for allocation and dispatch
        run()
    medians, disturbed = settled_medians(timers, REPEATS, patience_s)
    timings = [Timing(name, rows, medians[(name, rows, "native")],
                      medians[(name, rows, "onednn")]) for name, rows in parts]
    timings += [Timing("attention", key[1], medians[key], medians[("attention", key[1],
                                                                    "onednn", key[3])], key[3])
                for key in medians if key[0] == "attention" and key[2] == "native"]
    return timings, disturbed


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def attention_runs(cfg, rows: int, context: int, kv_dtype: torch.dtype, g: torch.Generator):
    """Two functions: one layer's attention of `rows` prompt rows ending at `context` on the
    native kernel and on `prefill_attention`, over a pool of random keys and values."""
    bs = 16
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    num_blocks = -(-context // bs)
    shape = (num_blocks, kv_heads, bs, hd)
    k_pool = torch.randn(shape, generator=g).to(kv_dtype)
    v_pool = torch.randn(shape, generator=g).to(kv_dtype)
    table = torch.arange(num_blocks, dtype=torch.int32)  # [num_blocks]
    q = torch.randn(rows, heads, hd, generator=g)
    pos = torch.arange(context - rows, context, dtype=torch.int32)
    seq = torch.zeros(rows, dtype=torch.int32)
    scale = cfg.attn_scale if cfg.attn_scale is not None else hd ** -0.5
    masks = attention_masks(context - rows, rows, heads // kv_heads)
    return (partial(ragged_attention, q, k_pool, v_pool, table[None], seq, pos, scale),
            partial(prefill_attention, q, k_pool, v_pool, table, context - rows, scale, masks))


def describe(choice: PrefillChoice, dense_bytes: int) -> str:
    """The start-up line's account of the choice and what it was made from."""
    lines = [f"prefill path: {choice.label()}"
             + (" (the timings were disturbed)" if choice.disturbed else "")]
    if choice.projections:
        lines.append(f"dense bf16 copies {dense_bytes / 2**30:.2f} GiB")
    if choice.timings:
        lines.append("timed (native int4 vs onednn ms): " + ", ".join(
            f"{t.part}@{t.context or t.rows}{'' if not t.context else f'/{t.rows}rows'} "
            f"{t.native_s * 1e3:.2f} vs {t.onednn_s * 1e3:.2f}" for t in choice.timings))
    return "; ".join(lines)


def apply(runner, config) -> None:
    """Choose `runner`'s prefill path for an engine of `config` (`EngineConfig`), take it,
    and say it in the engine's log."""
    choice = choose(runner.model, config.prefill_path, config.max_num_batched_tokens,
                    config.max_model_len, runner.cache.dtype)
    runner.use_prefill(choice)
    log.info("specserve: %s", describe(choice, runner.prefill_bytes))
