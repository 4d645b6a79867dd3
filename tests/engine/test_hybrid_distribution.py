"""End to end on a tiny Qwen3.5 pair (target and a draft close to it, both with Gated DeltaNet
layers) at temperature 0.7, top-k 3: the engine's sampled continuations follow the exact law of
the target, enumerated with the target's own forward pass over each whole prefix (a fresh cache
and a fresh recurrent state each: no snapshots, no rollback, no batching). The draft's and the
target's state rollback after rejections, the bonus token and the scheduler are all on the
path of the samples and none on the path of the law."""

from __future__ import annotations

from collections import Counter

import pytest

from specserve.llm import LLM
from specserve.sampling.params import SamplingParams
from specserve.weights.loader import load_model
from tests import hybrid_tiny, tiny
from tests.engine.test_hybrid_speculation import perturbed
from tests.law import chi_square_p, enumerate_law, next_token_law

PROMPT = [5, 17, 33, 8]
N_TOKENS, K, SAMPLES, TOP_K, TEMPERATURE = 3, 2, 3000, 3, 0.7
ALPHA = 1e-3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("q35-law")
    target = hybrid_tiny.save(hybrid_tiny.build("qwen35", 0), d / "t")
    draft = hybrid_tiny.save(perturbed("qwen35", 0, 0.003), d / "d")
    return (load_model(target, "float32", weights="float32"),
            load_model(draft, "float32", weights="float32"))


def exact_law(model) -> dict[tuple[int, ...], float]:
    """Every continuation of N_TOKENS tokens with its probability (1 + 3 + 9 passes)."""
    return enumerate_law(lambda ids: next_token_law(model, ids, TOP_K, TEMPERATURE), PROMPT,
                         N_TOKENS)


def test_speculative_samples_follow_the_enumerated_law_of_the_target(pair):
    target, draft = pair
    llm = LLM(target, draft=draft, speculative_config=tiny.draft_spec(K), max_num_seqs=64,
              max_model_len=64)
    params = SamplingParams(n=SAMPLES, temperature=TEMPERATURE, top_k=TOP_K, seed=2025,
                            max_tokens=N_TOKENS, ignore_eos=True)
    (out,) = llm.generate(PROMPT, params)
    counts = Counter(tuple(c.token_ids) for c in out.outputs)
    assert chi_square_p(counts, exact_law(target.model)) > ALPHA
    # the test tells laws this close apart: the draft's own law is refused
    assert chi_square_p(counts, exact_law(draft.model)) < ALPHA
    metrics = llm.metrics()
    assert 0 < metrics["accepted"] < metrics["drafted"], metrics  # accepted and rejected
    assert len(llm.engine.runner.cache.states) == 0
