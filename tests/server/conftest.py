"""A real `specserve serve` process on a free localhost port, serving a tiny random model with
the same model as its draft (so speculation runs and is accepted), behind an API key."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import tiny

KEY = "test-key"
NAME = "tiny"
MAX_MODEL_LEN = 1024
MAX_REQUEST_BYTES = 200_000
SHUTDOWN_TIMEOUT = 1.5


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {KEY}"},
                            timeout=60, **kw)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, log_path: Path, *extra: str, startup_s: float = 180,
                 entry: tuple[str, ...] = ("specserve.cli",)) -> ServerProcess:
    """The server on a free port; `entry`: the module to run and its first arguments (e.g.
    `tests.server.faulty_serve` and its control folder)."""
    port = free_port()
    cmd = [sys.executable, "-m", *entry, "serve", "--model", str(model_dir),
           "--draft-model", str(model_dir), "--served-model-name", NAME, "--dtype", "float32",
           "--weights", "bf16", "--port", str(port), "--api-key", KEY,
           "--max-model-len", str(MAX_MODEL_LEN), "--max-request-bytes", str(MAX_REQUEST_BYTES),
           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--no-access-log", *extra]
    return launch(cmd, port, log_path, startup_s, threads=1)


def launch(cmd: list[str], port: int, log_path: Path, startup_s: float,
           threads: int) -> ServerProcess:
    """Run the server command `cmd` (listening on `port`) and wait until /health answers."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
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
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"server did not come up in {startup_s} s:\n{server.log}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path_factory.mktemp("tiny-serve"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_server(model_dir, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def real_server(tmp_path_factory):
    """A server on the real default model pair, shared by the end-to-end tests that need it
    (`real_serve.py`)."""
    from tests.server.real_serve import start_real_server

    srv = start_real_server(tmp_path_factory.mktemp("real-serve") / "server.log")
    yield srv
    srv.stop()
