"""Decoding under a grammar: speculation stays exact, and the grammar drafts.

A bigram toy over a five-token vocabulary ('a', 'b', 'c', 'd' and EOS) whose constrained law
is enumerated in closed form (at each step the target's row masked by the grammar and
renormalized); real tiny checkpoints for greedy equality."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from specserve.engine.engine import LLMEngine
from specserve.llm import LLM
from specserve.models.tokenizer import Tokenizer
from specserve.sampling.grammar import GrammarCompiler
from specserve.sampling.params import SamplingParams
from specserve.sampling.structured import StructuredOutputsParams
from tests import tiny, toy
from tests.engine.test_speculative_distribution import chi_square_p

LETTERS = "abcd"
EOS = len(LETTERS)
V = EOS + 1
REGEX = "ab[abc]{0,3}d"  # forced 'a' 'b', then a free stretch, then a forced end
N = 6  # tokens generated at most: the longest output is 6 letters then EOS (cut by max_tokens)
SAMPLES = 6000
ALPHA = 1e-3


def letters_tokenizer() -> Tokenizer:
    """One token per letter (byte-level pieces) and a special EOS."""
    backend = HFTokenizer(models.BPE({c: i for i, c in enumerate(LETTERS)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<eos>", normalized=False, special=True)])
    return Tokenizer(backend, frozenset({EOS}), None, False, None, {"eos_token": "<eos>"})


def grammar_engine(P, Q, k: int, method: str = "hybrid") -> LLMEngine:
    base = toy.toy_engine(P, Q, k, method=method, max_len=64,
                          spec_fields={"suffix_cache_tokens": 0} if method == "hybrid" else None)
    tokenizer = letters_tokenizer()
    return LLMEngine(base.runner, base.scheduler.blocks, tokenizer, base.config, base.spec,
                     grammars=GrammarCompiler(tokenizer, V))


def constrained_law(P: torch.Tensor, grammar, first: int, n: int) -> dict[tuple, float]:
    """Exact law of up to `n` tokens after `first` under the grammar: each step samples from
    the target's row masked by what the grammar allows, renormalized; EOS ends the output."""
    P = (P / P.sum(-1, keepdim=True)).double()
    law: dict[tuple, float] = {}
    matcher = grammar.matcher()

    def walk(seq: tuple, prob: float) -> None:
        if len(seq) == n:
            law[seq] = law.get(seq, 0.0) + prob
            return
        allowed = matcher.allowed()[:V].double()
        row = P[seq[-1] if seq else first] * allowed
        row = row / row.sum()
        for y in range(V):
            if row[y] == 0:
                continue
            if y == EOS:
                law[seq + (y,)] = law.get(seq + (y,), 0.0) + prob * float(row[y])
                continue
            assert matcher.accept(y)
            walk(seq + (y,), prob * float(row[y]))
            matcher.rollback(1)

    walk((), 1.0)
    return law


def sample_outputs(engine: LLMEngine, spec, samples: int, seed: int) -> Counter:
    for i in range(samples):
        engine.add_request([EOS, 0, 1], SamplingParams(
            temperature=1.0, max_tokens=N, seed=seed + i, structured_outputs=spec))
    return Counter(tuple(o.outputs[0].token_ids) for o in toy.run_all(engine))


@pytest.mark.parametrize("method,k", [("hybrid", 3), ("draft_model", 4), ("suffix", 2),
                                      ("grammar", 4)])
def test_speculative_constrained_decoding_follows_the_constrained_target_law(method, k):
    """Draft model (its own proposals masked alike), lookup and grammar sources, batched:
    the outputs follow the law of constrained target-only decoding exactly (χ², fixed seed)."""
    P, Q = toy.random_table(V, seed=3), toy.random_table(V, seed=4, concentration=0.3)
    engine = grammar_engine(P, Q if method in ("hybrid", "draft_model") else None, k, method)
    spec = StructuredOutputsParams(regex=REGEX)
    counts = sample_outputs(engine, spec, SAMPLES, seed=11)
    law = constrained_law(P, engine.grammars.compile(spec), first=1, n=N)
    assert chi_square_p(counts, law) > ALPHA
    assert engine.metrics.total.sources.get("grammar", [0])[0] > 0  # the grammar drafted


def test_the_constrained_law_test_catches_a_verifier_that_ignores_the_grammar(monkeypatch):
    """A can-fail check: with the mask left off the verify rows (drafts still follow the
    grammar), tokens the grammar forbids come out of the residual and the bonus, and their
    requests end outside the constrained law's support (failed, or cut off illegal)."""
    from specserve.engine import rounds

    monkeypatch.setattr(rounds, "constrain", lambda seq, prop, logits: logits)
    P, Q = toy.random_table(V, seed=3), toy.random_table(V, seed=4, concentration=0.3)
    engine = grammar_engine(P, Q, 3, "draft_model")
    spec = StructuredOutputsParams(regex=REGEX)
    counts = sample_outputs(engine, spec, 600, seed=11)
    law = constrained_law(P, engine.grammars.compile(spec), first=1, n=N)
    outside = sum(c for s, c in counts.items() if law.get(s, 0.0) == 0.0)
    assert outside > 0


def test_the_constrained_law_test_has_the_power_to_reject_a_legal_but_wrong_law(monkeypatch):
    """The can-fail twin of the χ² test itself: every verify row masked right but scored at
    the wrong temperature (a sharper law), so every output is legal; the same χ² test, on the
    same samples, rejects the law."""
    from specserve.engine import rounds

    masked = rounds.constrain
    monkeypatch.setattr(rounds, "constrain",
                        lambda seq, prop, logits: masked(seq, prop, logits) * 1.5)
    P, Q = toy.random_table(V, seed=3), toy.random_table(V, seed=4, concentration=0.3)
    engine = grammar_engine(P, Q, 3, "draft_model")
    spec = StructuredOutputsParams(regex=REGEX)
    counts = sample_outputs(engine, spec, SAMPLES, seed=11)
    law = constrained_law(P, engine.grammars.compile(spec), first=1, n=N)
    assert all(law.get(s, 0.0) > 0 for s in counts)  # legal: only the law is off
    assert chi_square_p(counts, law) < ALPHA


def test_every_constrained_output_matches_and_ends_where_the_grammar_does():
    P = toy.random_table(V, seed=5)
    engine = grammar_engine(P, toy.random_table(V, seed=6), 3, "hybrid")
    spec = StructuredOutputsParams(choice=("abc", "abd", "bcda"))
    for i in range(40):
        engine.add_request([0, 1], SamplingParams(temperature=1.0, max_tokens=10, seed=i,
                                                  structured_outputs=spec))
    outs = toy.run_all(engine)
    assert {o.outputs[0].finish_reason for o in outs} == {"stop"}
    texts = Counter(o.outputs[0].text for o in outs)
    assert set(texts) <= {"abc", "abd", "bcda"} and len(texts) >= 2


SCHEMA = {"type": "object", "properties": {  # bounded: greedy output ends within 80 tokens
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "maximum": 99,
                                                     "minimum": 0},
    "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 2}},
    "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny.load_int8_pair(tmp_path_factory)


@pytest.mark.parametrize("speculative_config", [
    tiny.draft_spec(4), tiny.draft_spec(-1),
    {"method": "hybrid", "model": "draft", "num_speculative_tokens": -1},
    {"method": "ngram", "num_speculative_tokens": 3}])
def test_greedy_constrained_speculative_equals_constrained_target_only(pair, speculative_config):
    target, draft = pair
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=spec)
              for spec in (StructuredOutputsParams(json=SCHEMA),
                           StructuredOutputsParams(json_object=True),
                           StructuredOutputsParams(regex="[a-f]{3,9}!"))]
    prompts = ["the cat", "in the hat sat", "x"]
    plain = LLM(target, speculative_config=None, max_num_seqs=4).generate(prompts, params)
    uses_draft = speculative_config["method"] != "ngram"
    spec = LLM(target, draft=draft if uses_draft else None, max_num_seqs=4,
               speculative_config=speculative_config).generate(prompts, params)
    for want, got in zip(plain, spec):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    schema_out, regex_out = plain[0].outputs[0], plain[2].outputs[0]
    assert schema_out.finish_reason == regex_out.finish_reason == "stop"  # complete outputs
    value = json.loads(schema_out.text)
    assert set(value) == {"name", "n", "tags"} and isinstance(value["n"], int)
    assert len(value["name"]) <= 6 and 0 <= value["n"] <= 99 and set(value["tags"]) <= {"x", "yz"}
    assert re.fullmatch("[a-f]{3,9}!", regex_out.text)
    drafted = Counter()
    for out in spec:
        drafted.update({name: counts[1] for name, counts in out.outputs[0].spec.sources.items()})
    assert drafted["grammar"] > 0  # forced keys and punctuation were drafted by the grammar


def test_a_bad_schema_is_refused_before_anything_is_queued(pair):
    llm = LLM(pair[0], speculative_config=None)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(
        json={"type": "array", "uniqueItems": True}))
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), bad])
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("method", ["hybrid", "draft_model", "suffix"])
def test_a_grammar_that_cannot_go_on_fails_its_request_alone(monkeypatch, method):
    """llguidance may give up mid-output (its per-step limits): that request ends with the
    error, wherever the grammar is asked (plan, draft, verify), and the others finish."""
    from specserve.sampling import grammar as grammar_module

    P, Q = toy.random_table(V, seed=3), toy.random_table(V, seed=4)
    engine = grammar_engine(P, Q if method != "suffix" else None, 3, method)
    spec = StructuredOutputsParams(regex="[abc]{0,20}d")
    engine.add_request([0, 1], SamplingParams(max_tokens=12, seed=1, structured_outputs=spec),
                       request_id="doomed")
    engine.add_request([0, 1], SamplingParams(max_tokens=12, seed=2, structured_outputs=spec),
                       request_id="fine")
    engine.add_request([0, 1], SamplingParams(max_tokens=12, seed=3, ignore_eos=True),
                       request_id="free")
    doomed = engine.requests["doomed"].seqs[0].grammar
    compute = grammar_module.GrammarMatcher._compute

    def failing(self):
        if self is doomed and len(engine.requests["doomed"].seqs[0].token_ids) >= 5:
            raise grammar_module.GrammarError("structured output cannot go on: limits")
        return compute(self)

    monkeypatch.setattr(grammar_module.GrammarMatcher, "_compute", failing)
    finals = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                finals[d.request_id] = d
    assert isinstance(finals["doomed"].error, grammar_module.GrammarError)
    assert finals["fine"].error is None and finals["free"].error is None
    assert finals["fine"].output.outputs[0].text.endswith("d")
    assert finals["free"].output.outputs[0].finish_reason == "length"
