"""A real `specserve serve` process on the default model pair (Qwen2.5-Coder 1.5B with its
0.5B draft), for the end-to-end tests that need a model that really calls tools."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from tests.conftest import real_model_path
from tests.server.conftest import KEY, ServerProcess, free_port

REAL_NAME = "qwen-coder"


def start_real_server(log_path: Path, startup_s: float = 600) -> ServerProcess:
    real_model_path(DEFAULT_TARGET), real_model_path(DEFAULT_DRAFT)  # a failure, never a skip
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--served-model-name", REAL_NAME,
           "--port", str(port), "--api-key", KEY, "--max-model-len", "2048", "--no-access-log"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "2"},
                                   cwd=Path(__file__).resolve().parents[2])
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"server did not come up in {startup_s} s:\n{server.log}")


def real_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=600)
