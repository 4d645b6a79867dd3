"""End to end on a tiny real transformer pair (the int8 target and draft): the engine's sampled
continuations follow the exact law of the target, found by enumerating every continuation
with the target's own forward pass on each whole prefix (a fresh cache each: no caching, no
rollback, no batching), the processing (temperature 0.7, top-k 3) written out here. The KV
caches, the scheduler, the rollback after rejections and the bonus token are all on the path
of the samples and none on the path of the law; a subtly broken residual must be caught. On
either prefill path (`prefill_path`): with "onednn" the law's passes take it for the prompt's
rows, as the engine's prefill does, and the continuation's rows stay native."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.llm import LLM
from specserve.models.prefill import ONEDNN, PrefillPath
from specserve.models.transformer import ForwardBatch
from specserve.sampling import rejection
from specserve.sampling.params import SamplingParams
from tests import tiny
from tests.slots import new_cache as slot_cache
from tests.law import chi_square_p, enumerate_law, top_k_law

PROMPT = [5, 17, 33, 8]
N_TOKENS, K, SAMPLES, TOP_K, TEMPERATURE = 3, 2, 4000, 3, 0.7
ALPHA = 1e-3


def next_token_law(model, ids: list[int], prefill: PrefillPath | None = None
                   ) -> dict[int, float]:
    """The processed distribution of the token after `ids`: the target's last logits over the
    whole prefix (the prompt's rows on the prefill path `prefill`, None: native), divided by
    the temperature, the top 3 kept and renormalised."""
    cache = slot_cache(model, 1, len(ids) + 1, dtype=model.kv_cache_dtype())
    batch = ForwardBatch.paged([ids], [0], [cache.table(0)], prefill=[len(PROMPT)])
    with torch.inference_mode():
        (logits,) = model.forward(batch, cache.pool, last_n=[1], prefill=prefill)
    return top_k_law(logits[-1], TOP_K, TEMPERATURE)


def exact_law(model, path: str = "native") -> dict[tuple[int, ...], float]:
    """Every continuation of N_TOKENS tokens with its probability (1 + 3 + 9 passes)."""
    prefill = PrefillPath.build(ONEDNN, model.layers, model.dense_weights) \
        if path == "onednn" else None
    return enumerate_law(lambda ids: next_token_law(model, ids, prefill), PROMPT, N_TOKENS)


def sample(target, draft, seed: int, path: str = "native") -> tuple[Counter, dict]:
    llm = LLM(target, draft=draft, speculative_config=tiny.draft_spec(K), max_num_seqs=64,
              max_model_len=64, prefill_path=path)
    params = SamplingParams(n=SAMPLES, temperature=TEMPERATURE, top_k=TOP_K, seed=seed,
                            max_tokens=N_TOKENS, ignore_eos=True)
    (out,) = llm.generate(PROMPT, params)
    return Counter(tuple(c.token_ids) for c in out.outputs), llm.metrics()


@pytest.fixture(scope="module")
def law(int8_pair):
    return exact_law(int8_pair[0].model)


@pytest.mark.parametrize("path", ["native", "onednn"])
def test_engine_samples_follow_the_enumerated_law_of_the_real_target(int8_pair, law, path):
    path_law = law if path == "native" else exact_law(int8_pair[0].model, path)
    if path != "native":  # the prefill path gives a law of its own (else this proves nothing new)
        assert max(abs(path_law[s] - law.get(s, 0)) for s in path_law) > 1e-4
    counts, metrics = sample(*int8_pair, seed=2024, path=path)
    assert chi_square_p(counts, path_law, strict=True) > ALPHA
    assert 0 < metrics["accepted"] < metrics["drafted"], metrics  # accepted and rejected drafts


def recover_from_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The bug: after a rejection, sample the target's p instead of normalize(max(p - q, 0))."""
    return p.clone()


def test_a_patched_residual_is_caught(int8_pair, law, monkeypatch):
    monkeypatch.setattr(rejection, "_residual_mass", recover_from_p)
    counts, _ = sample(*int8_pair, seed=2024)
    assert chi_square_p(counts, law, strict=True) < ALPHA
