"""Soak clients beyond plain chat: the agents' wires and model output shaped to stall a
tool-call parser. Each returns one outcome word: "ok", "4xx", "429", "5xx" or "lost".

- `agent_request`: one streaming request with a function tool on an agent's wire,
  `/v1/responses` (OpenAI's Responses API, as Codex sends it) or `/v1/messages` (Anthropic's
  Messages API, as Claude Code sends it): "ok" when the stream ends as its wire says it must
  (`response.completed` or `response.incomplete`; `message_stop`), an error event is "5xx"
  when it names a server error, else "4xx"; a stream that ends without its last event is
  "lost".
- `tool_storm`: a chat request with a tool, whose output a regex forces into `` ```{ ``
  `repeats` times (each `{` after a fence opens a candidate call the parser must look at; the
  rescanning parser of issue 60 took 0.84 s for 8k characters, 12.7 s for 32k, on the event
  loop), `STORM_CHOICES` choices, streamed or not by turn: "ok" when each choice is that
  text, whole, as content with no call.
"""

from __future__ import annotations

import json

import httpx

from specserve.bench import sse

STORM_UNIT = "```{"
STORM_CHOICES = 2
TOOL = {"name": "read_file", "description": "Read a file of the workspace.",
        "schema": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}
WIRES = ("responses", "messages")
DONE_EVENTS = {"responses": ("response.completed", "response.incomplete"),
               "messages": ("message_stop",)}


def _status_word(status: int) -> str:
    return "429" if status == 429 else "5xx" if status >= 500 else "4xx"


def agent_body(wire: str, model: str, prompt: str, max_tokens: int) -> dict:
    """A streaming request with one function tool, as the wire's agents send it."""
    if wire == "responses":
        return {"model": model, "input": [{"role": "user", "content": prompt}],
                "max_output_tokens": max_tokens, "stream": True,
                "tools": [{"type": "function", "name": TOOL["name"],
                           "description": TOOL["description"], "parameters": TOOL["schema"]}]}
    return {"model": model, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": prompt}],
            "tools": [{"name": TOOL["name"], "description": TOOL["description"],
                       "input_schema": TOOL["schema"]}]}


def agent_request(http: httpx.Client, wire: str, model: str, prompt: str,
                  max_tokens: int) -> str:
    """One streaming request on `wire` ("responses" or "messages"), read to its end."""
    try:
        with http.stream("POST", f"/v1/{wire}",
                         json=agent_body(wire, model, prompt, max_tokens)) as r:
            if r.status_code != 200:
                return _status_word(r.status_code)
            for event in sse.events(r.iter_lines()):
                if not isinstance(event, dict):  # a `[DONE]` (not these wires' end)
                    continue
                kind = event.get("type")
                if kind in DONE_EVENTS[wire]:
                    return "ok"
                if kind in ("error", "response.failed"):
                    text = json.dumps(event)
                    return "5xx" if any(word in text for word in (
                        "server_error", "api_error", "engine_dead", "engine_error")) else "4xx"
    except httpx.HTTPError:
        return "lost"
    return "lost"


def storm_body(model: str, repeats: int, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Read the file a.py."}],
            "tools": [{"type": "function", "function": {
                "name": TOOL["name"], "description": TOOL["description"],
                "parameters": TOOL["schema"]}}],
            "structured_outputs": {"regex": r"(```\{){%d}" % repeats},
            "max_tokens": len(STORM_UNIT) * repeats + 8, "n": STORM_CHOICES, "stream": stream}


def tool_storm(http: httpx.Client, model: str, repeats: int, stream: bool) -> str:
    """The pathological tool-call output: "ok" when every choice comes back as its text."""
    body, expected = storm_body(model, repeats, stream), STORM_UNIT * repeats
    try:
        if not stream:
            r = http.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                return _status_word(r.status_code)
            texts = [c["message"]["content"] or "" for c in r.json()["choices"]
                     if not c["message"].get("tool_calls")]
            return "ok" if texts == [expected] * STORM_CHOICES else "4xx"
        texts, calls, done = [""] * STORM_CHOICES, 0, False
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return _status_word(r.status_code)
            for event in sse.events(r.iter_lines()):
                if event == sse.DONE:
                    done = True
                    continue
                if "error" in event:
                    return "5xx" if "server_error" in json.dumps(event) else "4xx"
                for choice in event["choices"]:
                    delta = choice["delta"]
                    texts[choice["index"]] += delta.get("content") or ""
                    calls += len(delta.get("tool_calls") or [])
        if not done:
            return "lost"
        return "ok" if not calls and texts == [expected] * STORM_CHOICES else "4xx"
    except httpx.HTTPError:
        return "lost"

