"""docs/limits.md, written from the declarations: every limit and timeout of `specserve serve`
with its default. `python -m specserve.server.limits_doc > docs/limits.md` writes it; a test
checks that the file is what this writes and that every field of `ServerLimits` is in it.

Three tables: the server's flags (`ServerConfig`'s options: default and help as declared), the
fixed bounds of one request (read from the API's JSON schema: what a field's `maximum`,
`maxItems`, `maxLength` or `pattern` says; and the constants the structured outputs and the
JSON nesting bound declare), and the fixed times and sizes of the HTTP layer, the engine's step
trace and the replicas (read from their modules' constants; the replicas' module is read, not
imported, so no Ray is needed).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from specserve import json_depth
from specserve.engine import trace
from specserve.options import describe, flag_name
from specserve.sampling import grammar_source, structured
from specserve.clients.async_engine import HOLD_AFTER
from specserve.server import intake, run, streams
from specserve.server.config import ServerConfig
from specserve.server.limits import ServerLimits
from specserve.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       FunctionDefinition, JsonSchema, SpeculativeOptions)

HERE = Path(__file__).resolve().parent
FLAGS = ("max_request_bytes", "max_connections", "keep_alive_timeout", "header_timeout",
         "body_timeout", "write_timeout", "send_buffer_bytes", "max_unread_bytes",
         "max_preparing", "max_waiting",
         "max_new_tokens", "max_choices", "max_messages", "max_prompt_chars", "max_slot_share", "request_timeout",
         "step_timeout", "shutdown_timeout")
# (model, field, the JSON schema keyword that bounds it, the field as a client writes it, what)
REQUEST = (
    (CompletionRequest, "n", "maximum", "n", "completions per prompt (beyond the slot share "
     "they run a share at a time)"),
    (CompletionRequest, "prompt", "maxItems", "prompt", "prompts in one text completion request"),
    (CompletionRequest, "stop", "maxItems", "stop", "stop strings"),
    (CompletionRequest, "stop", "maxLength", "stop", "characters per stop string"),
    (CompletionRequest, "stop_token_ids", "maxItems", "stop_token_ids", "stop token ids"),
    (CompletionRequest, "logprobs", "maximum", "logprobs", "alternatives per token"),
    (ChatCompletionRequest, "top_logprobs", "maximum", "top_logprobs", "alternatives per token "
     "of a chat completion"),
    (CompletionRequest, "top_k", "maximum", "top_k", "the top-k filter's k, on every sampled row"),
    (SpeculativeOptions, "num_speculative_tokens", "maximum", "speculative.num_speculative_tokens",
     "draft length"),
    (SpeculativeOptions, "tv_entropy_top_k", "maximum", "speculative.tv_entropy_top_k",
     "the k of the mentored budget's entropy gate, on every verified row"),
    (SpeculativeOptions, "fly_top_k", "maximum", "speculative.fly_top_k",
     "the k of FLy's entropy gate, on every verified row"),
    (ChatCompletionRequest, "tools", "maxItems", "tools", "functions a chat request offers"),
    (FunctionDefinition, "name", "maxLength", "tools[].function.name",
     "characters of a function's name, which matches `{pattern}`"),
    (JsonSchema, "name", "maxLength", "response_format.json_schema.name",
     "characters of a response format's name"),
)
# (what, the constant, what it counts)
CONSTANTS = (
    ("any JSON: the body, a schema, tool arguments", json_depth.MAX_DEPTH,
     "levels of objects and arrays inside one another"),
    ("the output's constraint (`structured_outputs`, `response_format`, `tools`)",
     structured.MAX_SPEC_CHARS, "characters of the constraint as JSON text (schema, regex or "
     "choices)"),
    ("`structured_outputs.choice`", structured.MAX_CHOICES, "strings to choose from"),
    ("`structured_outputs.regex`, a schema's `pattern` and `patternProperties`",
     grammar_source.MAX_REGEX_SIZE, "atoms of a regex with its counted repetitions expanded"),
)
TIMES = (
    ("server/replicas/deployment.py", "STATS_PERIOD_S", "s between a replica's posts of its "
     "figures"),
    ("server/replicas/deployment.py", "MAX_POST_DELAY_S", "s at most between a replica's posts "
     "while the board does not answer (the delay doubles from the period)"),
    ("server/replicas/pool.py", "REFRESH_S", "s between the pool's refreshes of the figures"),
    ("server/replicas/pool.py", "STALE_S", "s after a replica's last post, or the last refresh "
     "the board answered, that it counts as gone (no replica: /health 503)"),
    ("server/replicas/pool.py", "CALL_TIMEOUT_S", "s a replica call may go without a delta"),
    ("server/replicas/pool.py", "CANCEL_GRACE_S", "s replicas get after the drain to send "
     "their aborts"),
    ("server/replicas/launch.py", "HEALTH_CHECK_PERIOD_S", "s between Ray Serve's probes of a "
     "replica"),
)


def flag_rows() -> list[str]:
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    rows = []
    for name in FLAGS:
        field = fields[name]
        default = "none" if field.default is None else f"{field.default:g}" \
            if isinstance(field.default, float) else str(field.default)
        rows.append(f"| `{flag_name(field)}` | {default} | {describe(field)['help']} |")
    return rows


def schema_bound(schema: dict, keyword: str) -> int | None:
    """The largest `keyword` anywhere in a property's schema (its alternatives, its items)."""
    found = [schema[keyword]] if keyword in schema else []
    for value in schema.values():
        for part in value if isinstance(value, list) else [value]:
            if isinstance(part, dict) and (bound := schema_bound(part, keyword)) is not None:
                found.append(bound)
    return max(found, default=None)


def request_rows() -> list[str]:
    rows = []
    for model, name, keyword, label, what in REQUEST:
        schema = model.model_json_schema()["properties"][name]
        bound = schema_bound(schema, keyword)
        rows.append(f"| `{label}` | {bound} | {what.format(pattern=schema.get('pattern'))} |")
    return rows + [f"| {label} | {value} | {what} |" for label, value, what in CONSTANTS]


def constant(relative: str, name: str) -> float:
    tree = ast.parse((HERE.parent / relative).read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(getattr(t, "id", None) == name for t in targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{relative} declares no {name}")


def time_rows() -> list[str]:
    rows = [f"| `Retry-After` | {ServerLimits().retry_after_s} | s a 429 asks the client to wait |",
            f"| `FORCED_END_S` (server/run.py) | {run.FORCED_END_S:g} | s open streams get to "
            f"send their end after a forced exit (a second SIGTERM) |",
            f"| intake threads (server/intake.py) | {intake.Intake.__init__.__defaults__[0]} | "
            f"worker threads that parse and tokenize |",
            "| transport buffer | 64 KiB | asyncio's write buffer per connection: beyond it, "
            "with the kernel's send buffer full, writing pauses and the write timeout runs (a "
            "streamed response waits long before, at `--max-unread-bytes`) |",
            f"| `HOLD_AFTER` (clients/async_engine.py) | {HOLD_AFTER} | deltas a stream's "
            f"reader leaves untaken before its engine request is held (released at half) |",
            f"| `READ_AHEAD` (server/streams.py) | {streams.READ_AHEAD} | chunks a stream is "
            f"read ahead of its client |",
            f"| `MAX_TRACE_BYTES` (engine/trace.py) | {trace.MAX_TRACE_BYTES} | bytes of the step "
            f"trace file (`--trace-steps`) before it is rotated to `<file>.1` |"]
    for relative, name, what in TIMES:
        rows.append(f"| `{name}` ({relative}) | {constant(relative, name):g} | {what} |")
    return rows


def render() -> str:
    head = ["# Limits and timeouts of `specserve serve`", "",
            "Written by `python -m specserve.server.limits_doc` from the declarations "
            "(`server/config.py`, `server/limits.py`, the API's schema, the replicas' constants); "
            "a test keeps this file in step with them.", ""]
    flags = ["## Flags", "", "| flag | default | what it bounds |", "|---|---|---|",
             *flag_rows(), ""]
    request = ["## One request (fixed; beyond them: 400 naming the field)", "",
               "| field | at most | what |", "|---|---|---|", *request_rows(),
               "| `max_tokens` | the context less the prompt | new tokens |",
               "| `fly_window` | none | only compared with the draft length: no work per step |",
               ""]
    times = ["## Fixed times and sizes", "", "| name | value | what |", "|---|---|---|",
             *time_rows(), ""]
    return "\n".join(head + flags + request + times)


if __name__ == "__main__":
    print(render(), end="")
