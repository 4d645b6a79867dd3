"""Speculation on a Qwen3.5 target (Gated DeltaNet layers: recurrent state rolled back by
snapshots) through `specserve.LLM`: greedy speculative output equals greedy decoding by fresh
full passes token for token with every drafter (a Qwen3.5 draft model, itself recurrent, that
agrees often, rarely or always; prompt lookup; suffix drafting), under preemption too; the
draft model's drafts are its own fresh greedy continuations after every rollback; and no
sequence's state outlives it.

The reference, `fresh_greedy`, computes each token by a new request whose prompt is all the
text so far, prefilled in one pass from position 0 (zero state): it shares no snapshot, no
rollback and no decode pass with the engine's speculative or target-only decoding, so a bug in
that state keeping cannot pass on both sides alike."""

from __future__ import annotations

import pytest
import torch

from specserve.llm import LLM
from specserve.weights.loader import load_model
from tests import hybrid_tiny, tiny

PROMPT = [5, 17, 33, 8, 90, 41, 3, 3, 12, 60, 44, 81, 19, 7]
N = 32


def perturbed(kind: str, seed: int, noise: float):
    """The seed's model with Gaussian noise of scale `noise` on every weight: a draft that
    agrees with the original most of the time."""
    model = hybrid_tiny.build(kind, seed)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return model


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """(target, a draft of another seed, a draft close to the target), float32."""
    d = tmp_path_factory.mktemp("qwen35-spec")

    def load(model, name):
        return load_model(hybrid_tiny.save(model, d / name), "float32", weights="float32")

    return (load(hybrid_tiny.build("qwen35", 0), "t"), load(hybrid_tiny.build("qwen35", 1), "o"),
            load(perturbed("qwen35", 0, 0.003), "p"))


def specs(models) -> dict[str, tuple[dict, object]]:
    target, other, close = models
    return {"draft-other": (tiny.draft_spec(3), other), "draft-close": (tiny.draft_spec(4), close),
            "draft-same": (tiny.draft_spec(3), target),
            "ngram": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 2}, None),
            "suffix": ({"method": "suffix", "num_speculative_tokens": 3}, None)}


def fresh_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by fresh full passes (see the module docstring)."""
    llm = LLM(model, speculative_config=None, enable_prefix_caching=False)
    ids = list(prompt)
    for _ in range(n):
        ids += llm.generate([ids], tiny.greedy(1))[0].outputs[0].token_ids
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def reference(qwen35) -> list[int]:
    return fresh_greedy(qwen35[0], PROMPT, N)


def states_held(llm: LLM) -> int:
    """Sequences whose recurrent state the target's and the draft's caches still hold."""
    held = len(llm.engine.runner.cache.states)
    draft = getattr(llm.engine.spec, "model", None) if llm.engine.spec is not None else None
    if draft is not None:
        held += len(draft.runner.cache.states)
    return held


@pytest.mark.parametrize("name", ["draft-other", "draft-close", "draft-same", "ngram", "suffix"])
def test_greedy_speculation_equals_fresh_full_passes_token_for_token(qwen35, reference, name):
    target = qwen35[0]
    plain = LLM(target, speculative_config=None).generate(PROMPT, tiny.greedy(N))[0].outputs[0]
    assert plain.token_ids == reference  # target-only decoding (its snapshots) too
    spec, draft = specs(qwen35)[name]
    llm = LLM(target, draft=draft, speculative_config=spec)
    out = llm.generate(PROMPT, tiny.greedy(N))[0].outputs[0]
    assert out.token_ids == reference
    assert out.spec.drafted > 0
    if name == "draft-same":
        assert out.spec.accepted == out.spec.drafted
    if name == "draft-close":  # accepted and rejected drafts: rollback into a verify pass
        assert 0 < out.spec.accepted < out.spec.drafted, out.spec
    assert states_held(llm) == 0


def test_preempted_sequences_recompute_their_state_and_finish_exactly(qwen35):
    """A KV budget too small for all requests at once: preempted sequences lose their blocks
    and their recurrent state, start again from position 0, and give the tokens they give
    alone; nothing is held at the end."""
    target, _, close = qwen35
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(6)]
    alone = [fresh_greedy(target, p, 24) for p in prompts]
    per_token = target.model.kv_bytes_per_token() + close.model.kv_bytes_per_token()
    llm = LLM(target, draft=close, speculative_config=tiny.draft_spec(3), max_model_len=48,
              kv_cache_memory=6 * 16 * per_token)
    outs = llm.generate(prompts, [tiny.greedy(24)] * len(prompts))
    assert llm.engine.stats().preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert states_held(llm) == 0
    assert llm.engine.stats().kv_blocks_used == 0


def test_every_draft_is_the_draft_models_fresh_greedy_continuation_after_rollbacks(
        qwen35, monkeypatch):
    """The close draft's rejected drafts roll its own recurrent state back; a wrong rollback
    would only lower acceptance (verification keeps the output exact), so each round's drafts
    are compared with the draft model's greedy continuation by fresh full passes of the text
    the round started from."""
    from specserve.speculative.draft_model import DraftModelDrafter

    target, _, close = qwen35
    rounds: list[tuple[list[int], list[int]]] = []
    proposal = DraftModelDrafter._proposal

    def recording(self, seq, k):
        prop = proposal(self, seq, k)
        if prop.tokens:
            rounds.append((list(seq.token_ids), list(prop.tokens)))
        return prop

    monkeypatch.setattr(DraftModelDrafter, "_proposal", recording)
    out = LLM(target, draft=close, speculative_config=tiny.draft_spec(4)).generate(
        PROMPT, tiny.greedy(N))[0].outputs[0]
    assert 0 < out.spec.accepted < out.spec.drafted  # rejections: rollbacks happened
    assert len(rounds) > 3
    for text, drafts in rounds:
        assert drafts == fresh_greedy(close, text, len(drafts)), len(text)


def test_prefix_caching_is_off_for_a_recurrent_model(qwen35):
    llm = LLM(qwen35[0], speculative_config=None, enable_prefix_caching=True)
    assert llm.engine.runner.recurrent
    assert not llm.engine.scheduler.blocks.prefix_caching


def test_gemma4_speculation_equals_fresh_full_passes_token_for_token(tmp_path):
    """Gemma 4 (sliding windows shorter than the text, KV-sharing layers, per-layer inputs)
    with a draft close to it: rollback is arithmetic on the shared and own KV pools."""
    target = load_model(hybrid_tiny.save(hybrid_tiny.build("gemma4", 0), tmp_path / "t"),
                        "float32", weights="float32")
    close = load_model(hybrid_tiny.save(perturbed("gemma4", 0, 0.003), tmp_path / "d"),
                       "float32", weights="float32")
    out = LLM(target, draft=close, speculative_config=tiny.draft_spec(3)).generate(
        PROMPT, tiny.greedy(N))[0].outputs[0]
    assert out.token_ids == fresh_greedy(target, PROMPT, N)
    assert 0 < out.spec.accepted < out.spec.drafted, out.spec
