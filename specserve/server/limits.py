"""`ServerLimits`: how much one request, one client and the whole server may ask for.

Every bound the HTTP layer enforces lives here, with its default, so `build_app` and the
`serve` flags share one declaration (docs/limits.md lists them all, with the fixed per-request
bounds of the API; a test keeps it in step):

- per request: `max_new_tokens` (the most new tokens one completion gets, as llama-server's
  `-n`: a request asking for more, or for none, gets this many; None: the room the context
  leaves), `max_choices` (prompts × n, 400 beyond), `max_prompt_chars` (characters of
  prompt text, counted before tokenizing, 400 beyond; None: derived from the context,
  `prompt_char_bound`), `max_messages` (messages of a chat request, and text parts over all
  of them, counted before the body is validated, 400 beyond), `max_slot_share` (the share of
  the engine's sequence slots one request may hold at once: a request with more sequences
  runs a share at a time), `request_timeout` (seconds from admission to the last token; None:
  none; beyond it the request is aborted with 504);
- admission: `max_waiting` (sequences admitted beyond the engine's slots; a request that
  would pass it gets 429 with `Retry-After: retry_after_s`), `max_preparing` (requests being
  parsed or tokenized at once, queued or running; one more gets 429);
- text: `special_tokens_in_prompts` (False: the text of a special token in a prompt or a
  message is text; True: it becomes the token, as the model's own tokenizer would do);
- HTTP: `allowed_hosts` (the Host names served: loopback names by default, "*" for any),
  `max_connections` (open connections; uvicorn answers 503 beyond), `keep_alive_s` (an idle
  kept-alive connection is closed after it), `header_timeout_s` (a connection that has not
  sent a request's headers in this time is closed), `body_timeout_s` (a request whose body has
  not arrived whole this long after its head gets 408 and is closed), `send_buffer_bytes`
  (the kernel's send buffer of each connection, fixed: what a client can leave unread before
  writing to it pauses), `write_timeout_s` (a connection whose writing stays paused this long,
  its client reading nothing, is dropped, and its request aborted), `max_unread_bytes` (what
  a streaming client may leave unread, sent or waiting to be, before its stream waits for it:
  its engine request is then held, its slot given to others, until it reads; one that reads
  nothing for `write_timeout_s` more is dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_choices: int = 16
    max_prompt_chars: int | None = None
    max_messages: int = 1024
    max_slot_share: float = 0.5
    request_timeout: float | None = None
    max_waiting: int = 256
    max_preparing: int = 16
    retry_after_s: int = 1
    special_tokens_in_prompts: bool = False
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    max_connections: int = 512
    keep_alive_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    send_buffer_bytes: int = 256 << 10
    max_unread_bytes: int = 32 << 10
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        counts = ("max_choices", "max_messages", "max_preparing", "retry_after_s",
                  "max_connections", "send_buffer_bytes", "max_unread_bytes")
        optional = tuple(n for n in ("max_prompt_chars", "max_new_tokens")
                         if getattr(self, n) is not None)
        for name in counts + optional:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) \
                or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if not 0 < self.max_slot_share <= 1:
            raise ValueError(f"max_slot_share must be in (0, 1], got {self.max_slot_share!r}")
        for name in ("request_timeout", "keep_alive_s", "header_timeout_s", "body_timeout_s",
                     "write_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if not self.allowed_hosts or not all(isinstance(h, str) and h for h in self.allowed_hosts):
            raise ValueError(f"allowed_hosts must be non-empty host names, got {self.allowed_hosts!r}")
        object.__setattr__(self, "allowed_hosts", tuple(h.lower() for h in self.allowed_hosts))

    def for_model(self, max_model_len: int, longest_token_chars: int) -> ServerLimits:
        """These limits with the prompt character bound a model implies (`prompt_char_bound`),
        unless one is set."""
        if self.max_prompt_chars is not None:
            return self
        return replace(self, max_prompt_chars=prompt_char_bound(max_model_len,
                                                                longest_token_chars))

    def slots_per_request(self, max_num_seqs: int) -> int:
        """Sequences one request may hold in the engine at once (at least one)."""
        return max(1, math.floor(self.max_slot_share * max_num_seqs))

    def allows_host(self, host_header: str) -> bool:
        """Whether a request's Host header (port and all) names this server."""
        if "*" in self.allowed_hosts:
            return True
        host = host_header.strip().lower()
        if host.startswith("["):  # [::1]:8000
            host = host[1:host.find("]")] if "]" in host else ""
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        return host in self.allowed_hosts


def prompt_char_bound(max_model_len: int, longest_token_chars: int) -> int:
    """Characters of prompt text that cannot fit a context of `max_model_len` tokens when no
    token stands for more than `longest_token_chars` characters: one beyond is sure to be
    refused after tokenizing, so it is refused before."""
    return max_model_len * max(1, longest_token_chars)
