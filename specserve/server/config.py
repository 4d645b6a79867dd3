"""`ServerConfig`: what `specserve serve` needs beyond the `LLM`'s configuration (the HTTP
side, shutdown, replicas, the limits of `ServerLimits` and the engine's step watchdog), each
field declared once as an option (see `specserve.options`): the field is the flag
(`--max-request-bytes`), and `__post_init__` checks it with a `ValueError` naming it. A new
server option is a new field here (and its check).

The limit fields become a `ServerLimits` (`limits()`, the bounds the app and uvicorn enforce;
see `server/limits.py`), whose own checks are the limits' checks: its field names that differ
from the flags' (`keep_alive_s`, `header_timeout_s`, `special_tokens_in_prompts`) are reworded
to this config's."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.options import option
from specserve.sampling.params import require_bool, require_int, require_real
from specserve.server.limits import ServerLimits

LIMITS = ServerLimits()
# ServerLimits's fields under another name here (the flags' names)
LIMIT_NAMES = {"keep_alive_s": "keep_alive_timeout", "header_timeout_s": "header_timeout",
               "body_timeout_s": "body_timeout", "write_timeout_s": "write_timeout",
               "special_tokens_in_prompts": "allow_special_tokens"}

DEFAULT_MAX_BODY_BYTES = 4 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    served_model_name: str | None = option(
        None, "the name clients send as `model` (default: --model as given)")
    host: str = option("127.0.0.1", "the address to listen on")
    port: int = option(8000, "the port to listen on")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on /v1/ routes (default: $SPECSERVE_API_KEY; "
        "none: open)", env="SPECSERVE_API_KEY")
    max_request_bytes: int = option(DEFAULT_MAX_BODY_BYTES, "largest request body")
    shutdown_timeout: float = option(30.0, "seconds in-flight requests get to finish after "
                                     "SIGTERM")
    log_level: str = option("info", "uvicorn's and the server's log level", choices=LOG_LEVELS)
    access_log: bool = option(True, "log every HTTP request")
    replicas: int | None = option(
        None, "serve N engine replicas as Ray Serve deployments behind this one endpoint "
        "(default: one engine in this process, no Ray)")
    ray_address: str | None = option(
        None, "join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting a "
        "local Ray instance")
    # limits (what one request, one client and the server may ask for): see ServerLimits
    max_waiting: int = option(LIMITS.max_waiting, "sequences admitted beyond the engine's "
                              "slots; beyond them requests get 429 with Retry-After")
    request_timeout: float | None = option(
        LIMITS.request_timeout, "seconds a request may run before it is aborted with 504 "
        "(default: none)")
    max_slot_share: float = option(LIMITS.max_slot_share, "share of the sequence slots one "
                                   "request may hold at once")
    max_choices: int = option(LIMITS.max_choices, "prompts × n per request")
    max_new_tokens: int | None = option(
        LIMITS.max_new_tokens, "the most new tokens one completion gets: a request asking for "
        "more, or for none, gets this many (as llama-server's -n; default: the room the "
        "context leaves)")
    max_prompt_chars: int | None = option(
        LIMITS.max_prompt_chars, "characters of prompt text per request, checked before "
        "tokenizing (default: the context length times the longest token's characters, the "
        "most that could fit)")
    max_messages: int = option(LIMITS.max_messages, "messages of a chat request (and text parts "
                               "over all of them), checked before the body is validated")
    max_preparing: int = option(LIMITS.max_preparing, "requests being parsed or tokenized at "
                                "once; beyond them requests get 429 with Retry-After")
    allow_special_tokens: bool = option(
        LIMITS.special_tokens_in_prompts, "read special tokens' text in prompts and messages as "
        "the tokens (default: as text)")
    allowed_hosts: str = option(",".join(LIMITS.allowed_hosts), "comma-separated Host names "
                                "the server answers to, besides the --host address itself "
                                "('*': any)")
    max_connections: int = option(LIMITS.max_connections, "open connections at most (503 "
                                  "beyond)")
    keep_alive_timeout: float = option(LIMITS.keep_alive_s, "seconds an idle kept-alive "
                                       "connection stays open")
    header_timeout: float = option(LIMITS.header_timeout_s, "seconds a connection gets to "
                                   "send a request head")
    body_timeout: float = option(LIMITS.body_timeout_s, "seconds a request's body may take to "
                                 "arrive after its head (408 and closed beyond)")
    write_timeout: float = option(LIMITS.write_timeout_s, "seconds a client may leave what it "
                                  "was sent unread before its connection is dropped and its "
                                  "request aborted")
    send_buffer_bytes: int = option(LIMITS.send_buffer_bytes, "the kernel's send buffer per "
                                    "connection (SO_SNDBUF): what a client may leave unread of "
                                    "a response that is not streamed before the write timeout "
                                    "starts")
    max_unread_bytes: int = option(LIMITS.max_unread_bytes, "bytes a streaming client may "
                                   "leave unread before its stream waits for it (its engine "
                                   "request held, its slot to others) and the write timeout "
                                   "starts")
    step_timeout: float = option(300.0, "seconds one engine step may take before the engine "
                                 "counts as dead (503 engine_dead, /health 503)")

    def __post_init__(self) -> None:
        require_int("port", self.port, minimum=0, maximum=65535)
        require_int("max_request_bytes", self.max_request_bytes, minimum=1)
        timeout = require_real("shutdown_timeout", self.shutdown_timeout)
        if not timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key is not None and (not isinstance(self.api_key, str)
                                         or not self.api_key.strip()):
            raise ValueError("api_key must not be empty")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        require_bool("access_log", self.access_log)
        if self.replicas is not None:
            require_int("replicas", self.replicas, minimum=1)
        if self.ray_address is not None and self.replicas is None:
            raise ValueError("ray_address needs replicas")
        step = require_real("step_timeout", self.step_timeout)
        if not step > 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {self.step_timeout}")
        require_bool("allow_special_tokens", self.allow_special_tokens)
        if not isinstance(self.allowed_hosts, str):
            raise ValueError(f"allowed_hosts must be a comma-separated string, "
                             f"got {self.allowed_hosts!r}")
        try:
            self.limits()
        except ValueError as e:
            text = str(e)
            for limit, name in LIMIT_NAMES.items():
                text = text.replace(limit, name)
            raise ValueError(text) from None

    def limits(self) -> ServerLimits:
        """The `ServerLimits` of these flags; the address it binds, as a literal, is an allowed
        Host too (it names this server; a wildcard address adds nothing)."""
        hosts = tuple(h.strip() for h in self.allowed_hosts.split(",") if h.strip())
        bound = self.host.strip("[]").lower()
        if hosts and bound not in ("0.0.0.0", "::", "") and bound not in hosts:
            hosts += (bound,)
        return ServerLimits(
            max_choices=self.max_choices, max_prompt_chars=self.max_prompt_chars,
            max_messages=self.max_messages, max_slot_share=self.max_slot_share,
            request_timeout=self.request_timeout, max_waiting=self.max_waiting,
            max_preparing=self.max_preparing, special_tokens_in_prompts=self.allow_special_tokens,
            allowed_hosts=hosts, max_connections=self.max_connections,
            keep_alive_s=self.keep_alive_timeout, header_timeout_s=self.header_timeout,
            body_timeout_s=self.body_timeout, write_timeout_s=self.write_timeout,
            send_buffer_bytes=self.send_buffer_bytes, max_unread_bytes=self.max_unread_bytes,
            max_new_tokens=self.max_new_tokens)
