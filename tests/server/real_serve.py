"""A real `specserve serve` process on the default model pair (Qwen2.5-Coder 1.5B with its
0.5B draft), for the end-to-end tests that need a model that really calls tools."""

from __future__ import annotations

import sys
from pathlib import Path

import openai

from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from tests.conftest import real_model_path
from tests.server.conftest import KEY, ServerProcess, free_port, launch

REAL_NAME = "qwen-coder"


def start_real_server(log_path: Path, startup_s: float = 600) -> ServerProcess:
    real_model_path(DEFAULT_TARGET), real_model_path(DEFAULT_DRAFT)  # a failure, never a skip
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--served-model-name", REAL_NAME,
           "--port", str(port), "--api-key", KEY, "--max-model-len", "2048", "--no-access-log"]
    return launch(cmd, port, log_path, startup_s, threads=2)


def real_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=600)
