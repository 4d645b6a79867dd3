"""docs/limits.md is what `limits_doc` writes from the declarations, names every limit of
`ServerLimits`, and the per-request bounds it lists are enforced: one beyond is refused, by
the API's validation and by `SamplingParams` alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from specserve.sampling.params import SamplingParams
from specserve.server import limits_doc
from specserve.server.config import LIMIT_NAMES
from specserve.server.limits import ServerLimits
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "limits.md"
NOT_LIMITS = {"allowed_hosts", "special_tokens_in_prompts"}  # what is served, not how much


def test_the_limits_page_is_what_the_declarations_write():
    assert DOC.read_text() == limits_doc.render(), \
        "docs/limits.md is stale: python -m specserve.server.limits_doc > docs/limits.md"


def test_every_server_limit_has_a_row_with_its_default():
    page = DOC.read_text()
    for field in dataclasses.fields(ServerLimits):
        if field.name in NOT_LIMITS:
            continue
        if field.name == "retry_after_s":
            assert f"| `Retry-After` | {field.default} |" in page
            continue
        flag = "--" + LIMIT_NAMES.get(field.name, field.name).replace("_", "-")
        default = "none" if field.default is None else f"{field.default:g}" \
            if isinstance(field.default, float) else str(field.default)
        assert f"| `{flag}` | {default} |" in page, field.name


@pytest.mark.parametrize(("body", "param"), [
    ({"top_k": 1025}, "top_k"), ({"n": 17}, "n"), ({"logprobs": 21}, "logprobs"),
    ({"speculative": {"tv_entropy_top_k": 65}}, "speculative"),
    ({"speculative": {"fly_top_k": 65}}, "speculative"),
    ({"speculative": {"num_speculative_tokens": 17}}, "speculative")])
def test_one_beyond_a_listed_request_bound_is_refused(body, param):
    with pytest.raises(ValidationError) as refused:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    assert refused.value.errors()[0]["loc"][0] == param
    under = {k: (v - 1 if isinstance(v, int) else {kk: vv - 1 for kk, vv in v.items()})
             for k, v in body.items()}
    CompletionRequest.model_validate({"model": "m", "prompt": "x", **under})


@pytest.mark.parametrize("field", ["top_k", "tv_entropy_top_k", "fly_top_k"])
def test_sampling_params_refuse_the_same_bounds(field):
    bound = {"top_k": 1024, "tv_entropy_top_k": 64, "fly_top_k": 64}[field]
    SamplingParams(**{field: bound})
    with pytest.raises(ValueError, match=f"^{field} must be <= {bound}"):
        SamplingParams(**{field: bound + 1})


def tool(name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name}}


def test_the_listed_tool_bounds_hold_at_their_values_and_refuse_one_beyond():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    ChatCompletionRequest.model_validate({**chat, "tools": [tool(f"f{i}") for i in range(128)]})
    ChatCompletionRequest.model_validate({**chat, "tools": [tool("a.b-C_9" + "x" * 57)]})
    for tools in ([tool(f"f{i}") for i in range(129)], [tool("x" * 65)], [tool("a b")],
                  [tool("f()")]):
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest.model_validate({**chat, "tools": tools})
        assert refused.value.errors()[0]["loc"][0] == "tools"


def test_the_listed_constraint_bounds_hold_at_their_values_and_refuse_one_beyond():
    from specserve.json_depth import MAX_DEPTH
    from specserve.sampling.grammar_source import MAX_REGEX_SIZE, check_regex
    from specserve.sampling.structured import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputsParams

    page = DOC.read_text()
    for value in (MAX_DEPTH, MAX_SPEC_CHARS, MAX_CHOICES, MAX_REGEX_SIZE):
        assert f"| {value} |" in page
    fill = MAX_SPEC_CHARS - len('regex:""')
    StructuredOutputsParams(regex="a" * fill)
    with pytest.raises(ValueError, match="longer than 65536 characters"):
        StructuredOutputsParams(regex="a" * (fill + 1))
    StructuredOutputsParams(choice=["a"] * MAX_CHOICES)
    with pytest.raises(ValueError, match="at most 256"):
        StructuredOutputsParams(choice=["a"] * (MAX_CHOICES + 1))
    check_regex(f"a{{{MAX_REGEX_SIZE}}}", "regex")
    with pytest.raises(ValueError, match="too large"):
        check_regex(f"a{{{MAX_REGEX_SIZE + 1}}}", "regex")
    deep: object = {}
    for _ in range(MAX_DEPTH - 1):
        deep = {"a": deep}
    StructuredOutputsParams(json=deep)
    with pytest.raises(ValueError, match="nested more than 64"):
        StructuredOutputsParams(json={"a": deep})
