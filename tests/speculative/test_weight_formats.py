"""Every weight format starts and serves with the default speculation (hybrid: suffix drafting
and a draft model whose head is restricted to the frequent ids), for target and draft alike:
through `LLM()` per format, and through a `specserve serve` process with dense weights (the
formats whose draft head once failed to build: a dense `Linear` has no `out_features`)."""

from __future__ import annotations

import sys

import httpx
import pytest

from specserve.llm import LLM
from specserve.speculative.draft_head import RestrictedHead
from specserve.weights.quant import FORMATS
from tests import tiny
from tests.server.conftest import launch, free_port
from tests.server.draft_pair import save_pair

PROMPT = [(37 * j * j + 11 * j) % 97 + 5 for j in range(24)]  # no repeats for suffix drafting
KEEP = 48  # the draft head's kept ids: fewer than the tiny vocabulary's 112
# formats whose every row gives the same bits whatever else is in its pass (the native kernels),
# so greedy speculation equals greedy target-only decoding token for token; bf16 runs on
# PyTorch's matmuls, whose k + 1-row verify pass may round otherwise than a decode step
BATCH_INVARIANT = ("float32", "int8", "int4", "int4-all")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("pair"))


def hybrid(draft, k: int = -1) -> dict:
    """The default speculation (cost-aware k: -1) with `draft` and a restricted draft head."""
    return {"method": "hybrid", "model": str(draft), "draft_vocab_size": KEEP,
            "num_speculative_tokens": k}


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_starts_with_the_default_speculation_and_a_restricted_draft_head(pair, fmt):
    target, draft = pair
    llm = LLM(target, weights=fmt, speculative_config=hybrid(draft))
    drafter = llm.engine.spec.model
    assert isinstance(drafter.runner.head, RestrictedHead) and drafter.runner.head.keep == KEEP
    out = llm.generate(PROMPT, tiny.greedy(20))[0].outputs[0].token_ids
    assert len(out) == 20
    # a fixed k keeps the draft model drafting (cost-aware may judge it not worth it here)
    busy = LLM(target, weights=fmt, speculative_config=hybrid(draft, k=3))
    drafted = busy.generate(PROMPT, tiny.greedy(20))[0].outputs[0].token_ids
    assert busy.metrics()["by_source"]["draft_model"]["drafted"] > 0, \
        "the draft model never drafted: its format was not exercised"
    if fmt in BATCH_INVARIANT:
        plain = LLM(target, weights=fmt, speculative_config=None)
        assert out == drafted == plain.generate(PROMPT, tiny.greedy(20))[0].outputs[0].token_ids


@pytest.mark.parametrize("draft_fmt", FORMATS[1:])
def test_each_draft_format_drafts_for_an_int4_target(pair, draft_fmt):
    target, draft = pair
    spec = hybrid(draft, k=3) | {"draft_weights": draft_fmt}
    llm = LLM(target, weights="int4", speculative_config=spec)
    out = llm.generate(PROMPT, tiny.greedy(12))[0].outputs[0].token_ids
    plain = LLM(target, weights="int4", speculative_config=None)
    assert out == plain.generate(PROMPT, tiny.greedy(12))[0].outputs[0].token_ids


@pytest.mark.parametrize("fmt", ["bf16", "float32"])
def test_serve_starts_and_answers_with_dense_weights_and_the_draft(pair, fmt, tmp_path):
    target, draft = pair
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(target), "--draft-model",
           str(draft), "--draft-vocab-size", str(KEEP), "--weights", fmt, "--port", str(port)]
    server = launch(cmd, port, tmp_path / "server.log", startup_s=180, threads=1)
    try:
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": str(target), "prompt": "hello there", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.stop()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q4_K", "Q5_0"])
def test_a_restricted_head_of_the_files_own_blocks_keeps_its_rows(qtype):
    """The draft's head restricted to its first ids, on each kind a file's head arrives in:
    the kept rows give the full head's bits, the extra ids its dequantized rows' values."""
    import types

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T

    from specserve.speculative.draft_head import restricted_head
    from specserve.weights.file_blocks import native_blocks
    from specserve.weights.quant import NativeLinear

    rng = np.random.default_rng(3)
    vocab, hidden = 200, 256
    raw = tiny.quantize_raw(rng.standard_normal((vocab, hidden)).astype(np.float32), T[qtype], rng)
    head = NativeLinear.from_weights(native_blocks(raw, T[qtype], vocab, hidden), None)
    model = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=vocab), lm_head=head)
    restricted = restricted_head(model, 64, [150, 199])
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0))
    got, full = restricted(x), head(x)
    assert torch.equal(got[:, :64], full[:, :64])
    extra = x @ head.w.dequantize()[[150, 199]].t()
    assert torch.allclose(got[:, [150, 199]], extra, rtol=1e-4, atol=1e-4)
    assert torch.isinf(got[:, 64:150]).all() and torch.isinf(got[:, 151:199]).all()
