"""The agents' own wires beside chat completions: the OpenAI Responses API (`/v1/responses`:
Codex CLI, the OpenAI Agents SDK) and the Anthropic Messages API (`/v1/messages`,
`/v1/messages/count_tokens`: Claude Code, the Anthropic SDKs).

Each wire is two pieces: its request (a pydantic body and its conversion into the one internal
chat request, `ChatCompletionRequest`, so one template path, one tool-call parser and one
grammar serve every endpoint) and its renderer (the engine's output as the wire's body and
stream events). `output.py` is what both renderers share: a completion read into text and
whole tool calls.
"""
