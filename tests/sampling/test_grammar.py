"""Grammar matchers on a tiny byte-level vocabulary: masks, EOS, rollback, speculative masks,
forced tokens, and text around JSON values; one test on Qwen2.5's real vocabulary."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.sampling.grammar import GrammarCompiler, GrammarMatcher
from specserve.sampling.structured import Structural, StructuredOutputsParams
from tests.sampling.tiny_vocab import SPECIALS, UNUSED, byte_level, logits_width

TOOL = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
TOOL_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
SPECS = {
    "tool": StructuredOutputsParams(json=TOOL),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[a-z]+@[a-z]+\.(com|org)"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "not sure"]),
    "triggered": StructuredOutputsParams(structural=Structural(
        "<tool_call>\n", TOOL, "\n</tool_call>", separator="\n", triggered=True)),
}


@pytest.fixture(scope="module")
def tok():
    return byte_level()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, logits_width(tok))


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text)


def eos(tok) -> int:
    return next(iter(tok.eos_token_ids))


EOS = eos(byte_level())


def random_walk(m: GrammarMatcher, rng: random.Random, steps: int) -> tuple[list[int], list]:
    """Accept up to `steps` random legal tokens other than EOS: (tokens, the mask before each)."""
    tokens, masks = [], []
    for _ in range(steps):
        allowed = m.allowed()
        choices = [t for t in allowed.nonzero().flatten().tolist() if t != EOS]
        if not choices:
            break
        masks.append(allowed)
        tokens.append(rng.choice(choices))
        assert m.accept(tokens[-1])
    return tokens, masks


def test_a_valid_output_is_allowed_token_by_token_and_eos_only_at_its_end(tok, compiler):
    m = compiler.compile(SPECS["tool"]).matcher()
    for t in ids_of(tok, TOOL_TEXT):
        allowed = m.allowed()
        assert allowed.dtype == torch.bool and allowed.shape == (logits_width(tok),)
        assert allowed[t] and not allowed[eos(tok)] and not m.can_terminate
        assert m.accept(t)
    assert m.allowed().nonzero().flatten().tolist() == [eos(tok)] and m.can_terminate
    assert m.accept(eos(tok)) and m.is_terminated
    assert m.allowed().nonzero().flatten().tolist() == [eos(tok)]
    assert not m.accept(ids_of(tok, "}")[0])


def test_an_illegal_token_is_refused_and_leaves_the_state_unchanged(tok, compiler):
    m = compiler.compile(SPECS["tool"]).matcher()
    for t in ids_of(tok, TOOL_TEXT)[:6]:
        before = m.allowed()
        illegal = (~before).nonzero().flatten().tolist()
        for bad in [illegal[0], illegal[len(illegal) // 2], eos(tok), -1, logits_width(tok)]:
            assert not m.accept(bad)
        assert torch.equal(m.allowed(), before)
        assert m.accept(t)


def test_eos_is_legal_with_other_tokens_where_the_output_may_end_or_go_on(tok, compiler):
    m = compiler.compile(StructuredOutputsParams(regex="[0-9]+")).matcher()
    assert not m.allowed()[eos(tok)]
    assert m.accept(ids_of(tok, "4")[0])
    allowed = m.allowed()
    assert allowed[eos(tok)] and allowed[ids_of(tok, "2")[0]] and m.can_terminate


def test_control_unused_and_padding_ids_are_never_allowed(tok, compiler):
    never = [tok.backend.token_to_id(s) for s in SPECIALS if s != SPECIALS[1]]
    pads = [i for i in range(tok.vocab_size) if tok.backend.id_to_token(i).startswith("[PAD")]
    assert len(pads) == UNUSED
    never += pads + list(range(tok.vocab_size, logits_width(tok)))
    rng = random.Random(0)
    for name in ("json_object", "triggered"):
        for _ in range(4):
            m = compiler.compile(SPECS[name]).matcher()
            _, masks = random_walk(m, rng, 30)
            assert masks and not any(mask[never].any() for mask in masks)


@pytest.mark.parametrize("name", list(SPECS))
def test_rollback_restores_the_masks_of_random_walks(compiler, name):
    rng = random.Random(name)
    grammar = compiler.compile(SPECS[name])
    for _ in range(5):
        m = grammar.matcher()
        tokens, masks = random_walk(m, rng, 40)
        while tokens:
            n = rng.randint(1, min(len(tokens), 32))
            m.rollback(n)
            del tokens[-n:]
            assert torch.equal(m.allowed(), masks[len(tokens)])
            redo, _ = random_walk(m, rng, rng.randint(0, 3))
            m.rollback(len(redo))
        assert torch.equal(m.allowed(), grammar.matcher().allowed())


def step_by_step(m: GrammarMatcher, drafts: list[int]) -> tuple[list[torch.Tensor], int]:
    masks, legal = [m.allowed()], 0
    for t in drafts:
        if not m.accept(t):
            break
        legal += 1
        masks.append(m.allowed())
    m.rollback(legal)
    return masks, legal


@pytest.mark.parametrize("name", ["tool", "json_object", "triggered"])
def test_masks_equal_step_by_step_masks_and_leave_the_state_unchanged(tok, compiler, name):
    rng = random.Random(name)
    grammar = compiler.compile(SPECS[name])
    for trial in range(6):
        m = grammar.matcher()
        random_walk(m, rng, rng.randint(0, 5))
        drafts, _ = random_walk(m, rng, 12)
        complete = m.can_terminate
        m.rollback(len(drafts))
        if trial % 3 == 1 and len(drafts) > 2:  # an illegal draft in the middle
            at = len(drafts) // 2
            masks, _ = m.masks(drafts[:at])
            drafts[at] = int((~masks[at]).nonzero()[0])
        if trial % 3 == 2 and complete:  # EOS drafted where the output may end, twice
            drafts += [EOS, EOS]
        before = m.allowed()
        masks, legal = m.masks(drafts)
        expected, expected_legal = step_by_step(m, drafts)
        assert legal == expected_legal and masks.shape == (legal + 1, logits_width(tok))
        assert all(torch.equal(masks[i], expected[i]) for i in range(legal + 1))
        assert torch.equal(m.allowed(), before)
        if trial % 3 == 1 and len(drafts) > 2:
            assert legal == len(drafts) // 2


def test_forced_spells_the_required_key_after_the_brace(tok, compiler):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    m = compiler.compile(StructuredOutputsParams(json=schema)).matcher()
    text = tok.decode(m.forced(16))
    assert text.startswith('{"city"') and '{"city": "'.startswith(text)


def test_forced_ends_with_eos_where_the_rest_is_determined(tok, compiler):
    m = compiler.compile(SPECS["choice"]).matcher()
    assert m.forced(8) == []  # three choices: nothing is forced
    assert all(m.accept(t) for t in ids_of(tok, "not"))
    forced = m.forced(8)
    assert tok.decode(forced) == " sure" and forced[-1] == eos(tok)
    assert m.forced(2) == forced[:2]


def test_forced_leaves_the_state_unchanged(tok, compiler):
    m = compiler.compile(SPECS["tool"]).matcher()
    before = m.allowed()
    forced = m.forced(64)
    assert len(forced) > 3 and torch.equal(m.allowed(), before)
    for t in forced:
        assert m.allowed()[t] and m.accept(t)


def test_choice_allows_exactly_the_choices(tok, compiler):
    grammar = compiler.compile(SPECS["choice"])
    for text in ["yes", "no", "not sure"]:
        m = grammar.matcher()
        assert all(m.accept(t) for t in ids_of(tok, text)) and m.can_terminate
    m = grammar.matcher()
    assert not all(m.accept(t) for t in ids_of(tok, "nope"))


def accepts_text(grammar, tok, text: str, end: bool = True) -> bool:
    m = grammar.matcher()
    return all(m.accept(t) for t in ids_of(tok, text)) and (not end or m.can_terminate)


def test_structural_wraps_values_in_begin_separator_end(tok, compiler):
    spec = Structural("<tool_call>\n", {"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"]}, "\n</tool_call>", separator=", ")
    grammar = compiler.compile(StructuredOutputsParams(structural=spec))
    assert accepts_text(grammar, tok, '<tool_call>\n{"a": 1}\n</tool_call>')
    assert accepts_text(grammar, tok, '<tool_call>\n{"a": 1}, {"a": 22}\n</tool_call>')
    assert not accepts_text(grammar, tok, 'Sure. <tool_call>\n{"a": 1}\n</tool_call>')
    assert not accepts_text(grammar, tok, '<tool_call>\n{"a": 1}')
    begin = grammar.matcher().forced(4)
    assert tok.decode(begin[:1], skip_special_tokens=False) == "<tool_call>"
    glued = Structural("[", {"type": "integer"}, "]", separator="")
    grammar = compiler.compile(StructuredOutputsParams(structural=glued))
    assert accepts_text(grammar, tok, "[1]") and accepts_text(grammar, tok, "[12]")
    assert not accepts_text(grammar, tok, "[]")


def test_triggered_structural_allows_free_text_then_enforces_the_value(tok, compiler):
    grammar = compiler.compile(SPECS["triggered"])
    assert accepts_text(grammar, tok, "Sure, let me check the weather for you.")
    assert accepts_text(grammar, tok, "Sure.\n<tool_call>\n" + TOOL_TEXT + "\n</tool_call>")
    assert not accepts_text(grammar, tok, "Sure.\n<tool_call>\nThe weather", end=False)
    assert not accepts_text(grammar, tok, "Sure.\n<tool_call>\n" + TOOL_TEXT)


def test_triggered_structural_begin_spelled_in_pieces_starts_the_constraint(tok, compiler):
    m = compiler.compile(SPECS["triggered"]).matcher()
    pieces = [t for c in "Hi <tool_call>\n" for t in ids_of(tok, c)]
    assert all(m.accept(t) for t in pieces) and not m.can_terminate
    assert tok.decode(m.forced(4)).startswith('{"name')


def test_qwen_tool_call_forced_tokens_are_the_tokenizers_own():
    from tests.conftest import real_model_path
    from specserve.models.tokenizer import from_gguf_metadata
    from specserve.weights.gguf_loader import open_gguf, read_metadata

    qwen = from_gguf_metadata(read_metadata(open_gguf(real_model_path("qwen2.5-coder-1.5b"))))
    compiler = GrammarCompiler(qwen, 151936)
    spec = Structural("<tool_call>\n", TOOL, "\n</tool_call>")
    m = compiler.compile(StructuredOutputsParams(structural=spec)).matcher()
    forced = m.forced(64)
    text = qwen.decode(forced, skip_special_tokens=False)
    assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city"')
    assert forced == qwen.encode(text) and forced[0] == qwen.backend.token_to_id("<tool_call>")
    for t in qwen.encode("<tool_call>\n" + TOOL_TEXT + "\n</tool_call>"):
        assert m.accept(t)
    assert m.allowed().nonzero().flatten().tolist() == sorted(qwen.eos_token_ids)


def test_a_sentencepiece_style_vocabulary_is_enforced_and_drafted():
    from tests.sampling.tiny_vocab import sentencepiece_style

    spm = sentencepiece_style()
    compiler = GrammarCompiler(spm, spm.vocab_size + 3)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    m = compiler.compile(StructuredOutputsParams(json=schema)).matcher()
    assert spm.decode(m.forced(10)) == '{"a": "'
    ids = spm.encode('{"a": "ab é"}')[1:]  # without BOS
    assert all(m.accept(t) for t in ids) and m.can_terminate
    assert m.allowed().nonzero().flatten().tolist() == [2]  # </s>
