"""A named model is served: the default draft drafts only for the default target or a target of
its vocabulary (hybrid speculation); any other target gets suffix drafting (model-free), and the
log says so in one
line (`specserve/default_speculation.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from specserve.default_speculation import decide
from tests import tiny
from tests.conftest import real_model_path
from tests.server.conftest import free_port

DRAFT = {"method": "hybrid", "model": DEFAULT_DRAFT, "num_speculative_tokens": -1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": -1}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny.save_hf_dir(tiny.build_hf_model("qwen2"), tmp_path_factory.mktemp("tiny"))


def test_the_default_target_keeps_the_default_draft():
    config, reason = decide(DEFAULT_TARGET)
    assert config == DRAFT and "default pair" in reason


def test_a_target_of_the_drafts_vocabulary_gets_the_draft():
    config, reason = decide(real_model_path(DEFAULT_TARGET))  # by path, not by the alias
    assert config == DRAFT and "vocabulary" in reason


def test_a_target_of_another_vocabulary_gets_suffix_drafting(tiny_dir):
    real_model_path(DEFAULT_DRAFT)  # the comparison is made, not skipped for a missing draft
    config, reason = decide(tiny_dir)
    assert config == SUFFIX
    assert reason == (f"speculation: suffix drafting (model-free), cost-aware; the default "
                      f"draft {DEFAULT_DRAFT} has another vocabulary than {tiny_dir.name}")


def test_a_draft_not_downloaded_means_suffix_drafting(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    config, reason = decide(tiny_dir)
    assert config == SUFFIX and "not downloaded" in reason


def test_serve_with_only_a_model_answers_a_chat_request_and_says_why_it_drafts_so(tiny_dir, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", "--model", str(tiny_dir),
             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parents[2])
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.25)
        assert process.poll() is None, log_path.read_text()
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": str(tiny_dir), "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        process.terminate()
        process.wait(60)
    said = [line for line in log_path.read_text().splitlines() if "speculation: " in line]
    assert len(said) == 1 and "suffix drafting (model-free)" in said[0], log_path.read_text()
