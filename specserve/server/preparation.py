"""From an API request body to what the engine takes: prompt token ids, `SamplingParams` and a
`SpeculationOverride`, one `Job` per prompt. Every check a client can fail happens here, before
the engine sees anything, and raises an `APIError` (a 4xx with the offending field named).

The bounds of `ServerLimits` apply before any work is spent: prompts × n, the number of
messages, and the prompt text's length in characters before it is tokenized (a request's n
beyond its share of the sequence slots is not refused: it runs a share at a time,
`streams.parts`). The app runs these functions in its intake, on a worker thread. Message
content, tools and prompt text are encoded with special tokens' text as text unless the server
allows special tokens in prompts (`Tokenizer.encode_chat`).

Tools and structured outputs (`tool_calls/`): the chat prompt shows the tools as the model's
format wants them; the output's constraint becomes `SamplingParams.structured_outputs` and is
compiled here by the server's `GrammarCompiler`, if it has one (a constraint it cannot
compile is a 400 naming the field); a job whose output may hold tool calls says in which
format (`Job.tool_calls`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Protocol

from specserve.engine.outputs import SpeculationOverride
from specserve.models.tokenizer import Tokenizer
from specserve.sampling.params import SamplingParams
from specserve.sampling.structured import StructuredOutputsParams
from specserve.server.errors import APIError, from_value_error
from specserve.server.limits import ServerLimits
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from specserve.server.tool_calls import ToolSupport, tool_support
from specserve.server.tool_calls.constraints import (Constraint, allowed_names,
                                                     chat_constraint, completion_constraint)
from specserve.server.tool_calls.conversation import choice_of, template_inputs
from specserve.server.tool_calls.parser import ToolParsing


class GrammarCompiler(Protocol):
    """Compiles a request's constraint for the served model's vocabulary; a constraint it
    cannot enforce (e.g. an unsupported schema keyword) is a ValueError naming why."""

    def compile(self, spec: StructuredOutputsParams) -> object: ...


@dataclass(frozen=True)
class Job:
    """One prompt of an API request, ready for the engine. `grammar`: its
    `params.structured_outputs` compiled by the server's compiler, which the engine shares;
    held here for the request's life, so that the engine finds this grammar for every engine
    request of the job (every share of an `n` split) and never compiles it again. `tool_calls`:
    read tool calls out of the output in this format (None: the output is plain text)."""

    prompt_ids: list[int]
    params: SamplingParams
    speculation: SpeculationOverride | None
    tool_calls: ToolParsing | None = None
    grammar: object = None


@dataclass(frozen=True)
class ModelLimits:
    """What a request must fit: the served name, the context length, the vocabulary,
    whether the server drafts at all, and the engine's sequence slots (None: unknown)."""

    name: str
    max_model_len: int
    vocab_size: int
    speculative: bool
    max_num_seqs: int | None = None


def check_model(requested: str, limits: ModelLimits) -> None:
    if requested != limits.name:
        raise APIError(404, f"model {requested!r} does not exist; this server serves {limits.name!r}",
                       param="model", code="model_not_found")


def chat_jobs(req: ChatCompletionRequest, tokenizer: Tokenizer, limits: ModelLimits,
              server: ServerLimits = ServerLimits(), tools: ToolSupport | None = None,
              compiler: GrammarCompiler | None = None, bound_max_tokens: bool = False
              ) -> list[Job]:
    """The request's job; `tools`: the model's tool support (`tool_support`, computed here
    when not given); `bound_max_tokens`: a max_tokens beyond the room the prompt leaves in the
    context is that room (the agents' wires, whose clients ask for more than any context),
    not a 400."""
    check_model(req.model, limits)
    check_choices(1, req.n, limits, server)
    if len(req.messages) > server.max_messages:
        raise APIError(400, f"messages: {len(req.messages)} messages; this server takes at most "
                       f"{server.max_messages} per request", param="messages",
                       code="too_many_messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    tools = tools or tool_support(tokenizer)
    choice = choice_of(req)
    try:
        inputs = template_inputs(req, tools.format, tools.system_shown)
        constraint = chat_constraint(req, tools.format, choice)
    except ValueError as e:
        raise field_error(e) from e
    grammar = check_constraint(constraint, compiler)
    texts = [m["content"] or "" for m in inputs.messages]
    check_chars(sum(map(len, texts)) + len(json.dumps(inputs.tools or [])), "messages", server)
    try:
        ids = tokenizer.encode_chat(inputs.messages, add_generation_prompt=True,
                                    parse_special_in_content=server.special_tokens_in_prompts,
                                    tools=inputs.tools)
    except Exception as e:  # a template may refuse a conversation (e.g. roles out of order)
        raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from e
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    parsing = None if choice == "none" else ToolParsing(
        tools.format, 1 if req.parallel_tool_calls is False else None,
        frozenset(allowed_names(req, choice)))
    if bound_max_tokens and max_tokens is not None:
        max_tokens = min(max_tokens, max(1, limits.max_model_len - len(ids)))
    job = _job(req, ids, "messages", max_tokens, param, logprobs, limits, constraint,
               server.max_new_tokens)
    return [replace(job, tool_calls=parsing, grammar=grammar)]


def completion_jobs(req: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits,
                    server: ServerLimits = ServerLimits(),
                    compiler: GrammarCompiler | None = None) -> list[Job]:
    check_model(req.model, limits)
    try:
        constraint = completion_constraint(req)
    except ValueError as e:
        raise field_error(e) from e
    grammar = check_constraint(constraint, compiler)
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    check_choices(len(prompts), req.n, limits, server)
    check_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt", server)
    jobs = []
    for prompt in prompts:
        ids = (_encode(tokenizer, prompt, "prompt", server.special_tokens_in_prompts)
               if isinstance(prompt, str) else list(prompt))
        if any(t >= limits.vocab_size for t in ids):
            raise APIError(400, f"prompt: token ids must be < {limits.vocab_size}", param="prompt")
        jobs.append(replace(_job(req, ids, "prompt", req.max_tokens, "max_tokens", req.logprobs,
                                 limits, constraint, server.max_new_tokens), grammar=grammar))
    return jobs


def check_constraint(constraint: Constraint | None, compiler: GrammarCompiler | None) -> object:
    """The compiled grammar of a request's constraint (None without one or without a
    compiler); one the compiler refuses is a 400 naming the field it came from."""
    if constraint is None or compiler is None:
        return None
    try:
        return compiler.compile(constraint.params)
    except ValueError as e:
        raise APIError(400, f"{constraint.param}: {e}", param=constraint.param) from e


def field_error(e: ValueError) -> APIError:
    """A 400 for a `ValueError` whose message starts with the field's path."""
    field = re.match(r"[a-z_]+", str(e))
    return APIError(400, str(e), param=field.group() if field else None)


def check_choices(prompts: int, n: int, limits: ModelLimits, server: ServerLimits) -> None:
    """prompts × n within `max_choices` (an n beyond the request's share of the sequence slots
    runs a share at a time)."""
    if prompts * n > server.max_choices:
        raise APIError(400, f"n: {prompts} prompt(s) × n={n} asks for {prompts * n} completions; "
                       f"this server takes at most {server.max_choices} per request", param="n")


def check_chars(chars: int, param: str, server: ServerLimits) -> None:
    if server.max_prompt_chars is not None and chars > server.max_prompt_chars:
        raise APIError(400, f"{param}: the prompt text has {chars} characters; this server takes at "
                       f"most {server.max_prompt_chars}", param=param, code="context_length_exceeded")


def _encode(tokenizer: Tokenizer, text: str, param: str, parse_special: bool) -> list[int]:
    try:
        return tokenizer.encode(text, parse_special=parse_special)
    except Exception as e:  # e.g. a lone surrogate (valid JSON, not valid Unicode text)
        raise APIError(400, f"{param}: the text cannot be tokenized: {e}", param=param) from e


def _job(req: SamplingFields, ids: list[int], prompt_param: str, max_tokens: int | None,
         max_param: str, logprobs: int | None, limits: ModelLimits,
         constraint: Constraint | None = None, cap: int | None = None) -> Job:
    """`cap`: the server's `max_new_tokens` (None: none)."""
    ctx = limits.max_model_len
    if not ids:
        raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
    if len(ids) >= ctx:
        raise APIError(400, f"{prompt_param}: the prompt has {len(ids)} tokens; this model's context "
                       f"is {ctx} tokens, with room for at least one new token needed",
                       param=prompt_param, code="context_length_exceeded")
    if cap is not None:
        max_tokens = cap if max_tokens is None else min(max_tokens, cap)
    if max_tokens is None:
        max_tokens = ctx - len(ids)
    elif len(ids) + max_tokens > ctx and cap is not None and max_tokens == cap:
        max_tokens = ctx - len(ids)  # the server's own bound never refuses a request
    elif len(ids) + max_tokens > ctx:
        raise APIError(400, f"{max_param}: {max_tokens} new tokens do not fit: the prompt has "
                       f"{len(ids)} tokens and this model's context is {ctx} tokens (at most "
                       f"{ctx - len(ids)} new tokens)", param=max_param, code="context_length_exceeded")
    try:
        params = SamplingParams(
            n=req.n, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, max_tokens=max_tokens,
            stop=req.stop, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=logprobs, **lossy_fields(req),
            structured_outputs=constraint.params if constraint is not None else None)
    except ValueError as e:
        raise from_value_error(e) from e
    return Job(ids, params, speculation_override(req, limits))


LOSSY_FIELDS = ("tv_entropy_top_k", "fly_window", "fly_entropy_threshold", "fly_top_k",
                "fly_variant")


def lossy_fields(req: SamplingFields) -> dict:
    """The lossy verifiers' settings a `speculative` object gives, as SamplingParams fields."""
    spec = req.speculative
    if spec is None or isinstance(spec, bool) or not spec.enabled:
        return {}
    return {name: getattr(spec, name) for name in LOSSY_FIELDS if getattr(spec, name) is not None}


def speculation_override(req: SamplingFields, limits: ModelLimits) -> SpeculationOverride | None:
    """`speculative: false` → off; an object → its settings; omitted → the server's."""
    spec = req.speculative
    if spec is None:
        return None
    if spec is False or (not isinstance(spec, bool) and not spec.enabled):
        return SpeculationOverride(enabled=False)
    if not limits.speculative:
        raise APIError(400, "speculative: this server runs without speculative decoding (started "
                       "with --no-speculation or without a draft)", param="speculative")
    if spec is True:
        return SpeculationOverride()
    try:
        return SpeculationOverride(True, spec.num_speculative_tokens, spec.tv_budget)
    except ValueError as e:
        raise APIError(400, str(e), param="speculative") from e
