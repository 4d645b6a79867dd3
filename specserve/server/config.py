"""`ServerConfig`: what `specserve serve` needs beyond the `LLM`'s configuration (the HTTP
side, shutdown, replicas), each field declared once as an option (see `specserve.options`):
the field is the flag (`--max-request-bytes`), and `__post_init__` checks it with a
`ValueError` naming it. A new server option is a new field here (and its check)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.options import option
from specserve.sampling.params import require_bool, require_int, require_real

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
