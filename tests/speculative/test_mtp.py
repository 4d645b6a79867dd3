"""The target's own multi-token-prediction head as a drafter (`speculative/mtp.py`), driven
directly through `propose`/`observe`/`commit` beside a target runner and the greedy verifier
(what the engine will do once it hands the target's hidden states over): the output is the
target's greedy output token for token, with a random head (drafts almost never accepted) and
with a head fitted to the target's own trajectory (drafts accepted, all of them on the fitted
prompt, some elsewhere). The head loads from a Hugging Face directory (`mtp.*`) and from a
GGUF file (`blk.N.nextn.*`, block N after the main layers) to the same weights."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.engine.block_manager import BlockManager
from specserve.engine.runner import ModelRunner
from specserve.models.layer import rms_norm
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import verify_greedy
from specserve.speculative.mtp import MTPDrafter
from specserve.weights.loader import load_model
from tests import hybrid_tiny

PROMPT = [5, 17, 33, 8, 90, 41, 3, 3, 12, 60]
OTHER = [7, 7, 21, 60, 2, 44, 81, 19, 33]
N = 24


@dataclass
class Seq:
    token_ids: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    seq_id: int = 0
    generator: torch.Generator = field(default_factory=torch.Generator)
    prompt_len: int = 0


def speculate(model, prompt: list[int], k: int) -> tuple[list[int], int, int]:
    """Greedy speculative decoding of N tokens with the MTP drafter → (tokens, drafted,
    accepted); also checks that nothing is held afterwards."""
    runner = ModelRunner(model, num_blocks=16)
    blocks = runner.block_manager()
    drafter = MTPDrafter(model, model.mtp.new_pool(16), BlockManager(16, 16, False))
    seq, table = Seq(list(prompt), prompt_len=len(prompt)), blocks.new_table()
    drafter.start(seq)
    assert blocks.reserve(table, len(prompt))
    (logits,), (hidden,) = runner.forward_hidden([prompt], [0], [table], [1])
    drafter.observe(seq, 0, hidden)
    seq.token_ids.append(int(logits[-1].argmax()))
    drafted = accepted = 0
    while len(seq.token_ids) < len(prompt) + N:
        assert drafter.ready(seq)
        (proposal,) = drafter.propose([seq], [k])
        old_len, start = len(seq.token_ids), len(seq.token_ids) - 1
        rows = [seq.token_ids[-1]] + proposal.tokens
        assert blocks.reserve(table, start + len(rows))
        (logits,), (hidden,) = runner.forward_hidden([rows], [start], [table])
        result = verify_greedy(torch.tensor(proposal.tokens, dtype=torch.long), logits)
        drafter.observe(seq, start, hidden)
        seq.token_ids += result.tokens
        drafter.commit(seq, result.num_accepted, old_len)
        drafted, accepted = drafted + proposal.k, accepted + result.num_accepted
    drafter.finish(seq)
    blocks.free(table)
    assert len(runner.cache.states) == 0 and drafter.blocks.num_used == 0
    return seq.token_ids[len(prompt):len(prompt) + N], drafted, accepted


def target_only(model, prompt: list[int]) -> list[int]:
    runner = ModelRunner(model, num_blocks=16)
    blocks = runner.block_manager()
    table, ids = blocks.new_table(), list(prompt)
    assert blocks.reserve(table, len(prompt) + N)
    (logits,) = runner.forward([ids], [0], [table], [1])
    while len(ids) < len(prompt) + N:
        ids.append(int(logits[-1].argmax()))
        (logits,) = runner.forward([ids[-1:]], [len(ids) - 1], [table])
    blocks.free(table)
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(HF model, path with a random MTP head, path with a head fitted to PROMPT's whole
    greedy trajectory, path with one fitted to its first half)."""
    d = tmp_path_factory.mktemp("mtp")
    hf = hybrid_tiny.build("qwen35")
    random_head = hybrid_tiny.save(hf, d / "random", mtp_seed=3)
    model = load_model(random_head, "float32", weights="float32").model
    paths = []
    for name, upto in (("whole", N), ("half", N // 2)):
        path = hybrid_tiny.save(hf, d / name, mtp_seed=3)
        weights = load_file(str(path / "model.safetensors"))
        weights.update(fitted_head(model, upto))
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        paths.append(path)
    return hf, random_head, *paths


def fitted_head(model, upto: int) -> dict[str, torch.Tensor]:
    """Head weights that predict the token after next along PROMPT's greedy trajectory (its
    first `upto` generated tokens): the layer made the identity (zero output projections) and
    fc solved exactly (pseudo-inverse) so that fc([e_{t+1}, h_t]) is h_{t+1} / w (w: the
    head's final norm), whose RMSNorm with w is h_{t+1} up to a scale: the target's own
    prediction of x_{t+2}."""
    ids = PROMPT + target_only(model, PROMPT)[:upto]
    runner = ModelRunner(model, num_blocks=16)
    blocks = runner.block_manager()
    table = blocks.new_table()
    assert blocks.reserve(table, len(ids))
    _, (hidden,) = runner.forward_hidden([ids], [0], [table], [1])  # [T, hidden]
    head, eps = model.mtp, model.cfg.rms_norm_eps
    e = rms_norm(model.embed_tokens(torch.tensor(ids[1:])), head.embed_norm, eps)
    x = torch.cat([e, rms_norm(hidden[:-1], head.hidden_norm, eps)], dim=-1)  # [T - 1, 2 H]
    y = hidden[1:] / head.norm  # [T - 1, H]
    fc = (torch.linalg.pinv(x.double()) @ y.double()).T.float()  # [H, 2 H], the exact fit
    layer = "mtp.layers.0."
    return {"mtp.fc.weight": fc.contiguous(),
            layer + "self_attn.o_proj.weight": torch.zeros_like(head.block.mixer.o.weight),
            layer + "mlp.down_proj.weight": torch.zeros_like(head.block.down.weight)}


@pytest.mark.parametrize("k", [1, 3])
def test_a_random_head_drafts_and_the_output_stays_the_targets(checkpoints, k):
    model = load_model(checkpoints[1], "float32", weights="float32").model
    tokens, drafted, accepted = speculate(model, PROMPT, k)
    assert tokens == target_only(model, PROMPT)
    assert drafted > 0


def test_a_fitted_head_has_its_drafts_accepted_and_the_output_stays_the_targets(checkpoints):
    whole = load_model(checkpoints[2], "float32", weights="float32").model
    tokens, drafted, accepted = speculate(whole, PROMPT, 3)
    assert tokens == target_only(whole, PROMPT)
    assert accepted == drafted > 0  # the trajectory it was fitted to
    tokens, drafted, accepted = speculate(whole, OTHER, 3)
    assert tokens == target_only(whole, OTHER)
    half = load_model(checkpoints[3], "float32", weights="float32").model
    tokens, drafted, accepted = speculate(half, PROMPT, 3)
    assert tokens == target_only(half, PROMPT)
    assert 0 < accepted < drafted, (accepted, drafted)  # rejections: the head rolls back


def test_the_head_loads_from_gguf_as_from_the_hugging_face_directory(checkpoints, tmp_path):
    hf, random_head = checkpoints[:2]
    mtp = {n: t for n, t in load_file(str(random_head / "model.safetensors")).items()
           if n.startswith("mtp.")}
    path = hybrid_tiny.write_gguf(hf, "qwen35", tmp_path / "m.gguf", mtp=mtp)
    from_gguf = load_model(path, "float32", weights="float32").model.mtp
    from_hf = load_model(random_head, "float32", weights="float32").model.mtp
    for a, b in [(from_gguf.fc.weight, from_hf.fc.weight),
                 (from_gguf.embed_norm, from_hf.embed_norm), (from_gguf.norm, from_hf.norm),
                 (from_gguf.block.mixer.q.weight, from_hf.block.mixer.q.weight),
                 (from_gguf.block.attn_norm, from_hf.block.attn_norm)]:
        assert torch.equal(a, b)


def test_a_model_without_a_head_is_refused(tmp_path):
    model = load_model(hybrid_tiny.save(hybrid_tiny.build("qwen35"), tmp_path / "hf"),
                       "float32", weights="float32").model
    assert model.mtp is None
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        MTPDrafter(model, None, BlockManager(4, 16, False))


@pytest.mark.parametrize("k", [-1, 3])
def test_the_mtp_method_drafts_through_the_engine_and_keeps_target_only_greedy(tmp_path, k):
    """`speculative_config={"method": "mtp"}`: the engine hands the target's hidden states to
    the head after every pass (prefill chunks included) and the output is target-only's."""
    from specserve.llm import LLM

    model = hybrid_tiny.build("qwen35", seed=0)
    path = hybrid_tiny.save(model, tmp_path / "m", mtp_seed=3)
    target = load_model(path, "float32")
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    plain = LLM(target, speculative_config=None).generate([PROMPT, OTHER], params)
    mtp = LLM(target, speculative_config={"method": "mtp", "num_speculative_tokens": k},
              max_num_batched_tokens=4)  # prompts prefill in chunks
    outs = mtp.generate([PROMPT, OTHER], params)
    for want, got in zip(plain, outs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    if k > 0:  # a fixed k drafts every round: the head drafted, counted under its name
        assert sum(o.outputs[0].spec.sources["mtp"][1] for o in outs) > 0


def test_the_mtp_method_needs_a_head(tmp_path):
    from specserve.llm import LLM

    target = load_model(hybrid_tiny.save(hybrid_tiny.build("qwen35"), tmp_path / "m"), "float32")
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        LLM(target, speculative_config={"method": "mtp"})


LAW_TOKENS, LAW_SAMPLES, TOP_K, TEMPERATURE, ALPHA = 4, 3000, 3, 0.35, 1e-3


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "temperature-lost"])
def test_mtp_drafting_at_temperature_follows_the_targets_enumerated_law(checkpoints, monkeypatch,
                                                                        broken):
    """T = 0.35, top-k 3, k = 2 with the head fitted on PROMPT (drafts accepted and rejected):
    the engine's continuations of 4 tokens follow the target's law enumerated by fresh forward
    passes (χ², fixed seed). The can-fail twin: the drafts' distribution handed to the verifier with its
    temperature lost (flat over the head's top-k, not the q the drafts were sampled from):
    every output stays one the law allows, the acceptance test is wrong, and the same χ²
    test rejects the law."""
    from specserve.llm import LLM
    from tests.law import chi_square_p, enumerate_law, next_token_law

    if broken:
        from specserve.speculative.drafter import Proposal

        proposal = MTPDrafter._proposal

        def flat(k, drafted):
            prop = proposal(k, drafted)
            if prop.draft_probs is None:
                return prop
            support = (prop.draft_probs > 0).double()  # [k, vocab]
            return Proposal(prop.tokens, support / support.sum(-1, keepdim=True))

        monkeypatch.setattr(MTPDrafter, "_proposal", staticmethod(flat))
    target = load_model(checkpoints[2], "float32", weights="float32")
    llm = LLM(target, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              max_num_seqs=64, max_model_len=64)
    params = SamplingParams(n=LAW_SAMPLES, temperature=TEMPERATURE, top_k=TOP_K, seed=7,
                            max_tokens=LAW_TOKENS, ignore_eos=True)
    (out,) = llm.generate(PROMPT, params)  # the prompt the head was fitted on
    counts = Counter(tuple(c.token_ids) for c in out.outputs)
    metrics = llm.metrics()
    assert 0 < metrics["accepted"] < metrics["drafted"], metrics  # accepted and rejected
    law = enumerate_law(lambda ids: next_token_law(target.model, ids, TOP_K, TEMPERATURE),
                        PROMPT, LAW_TOKENS)
    assert all(law.get(s, 0.0) > 0 for s in counts)  # every output one the law allows
    p = chi_square_p(counts, law)
    assert (p < ALPHA) if broken else (p > ALPHA), p
