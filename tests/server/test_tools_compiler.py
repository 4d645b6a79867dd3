"""The grammar compiler the app is given: called on the preparation worker thread (never on the
event loop) with each request's constraint, its refusal a 400 naming the field; the app built
in-process around a tiny model's real engine."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from specserve.llm import LLM
from specserve.sampling.structured import StructuredOutputsParams
from specserve.server.app import build_app
from specserve.server.preparation import ModelLimits
from specserve.weights.loader import load_model
from tests import tiny


class ThreadRecordingCompiler:
    def __init__(self) -> None:
        self.calls: list[tuple[str, threading.Thread]] = []

    def compile(self, spec: StructuredOutputsParams) -> object:
        self.calls.append((spec.kind, threading.current_thread()))
        if spec.regex == "refuse me":
            raise ValueError("regex: lookaheads are not supported")
        return object()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2"), tmp_path_factory.mktemp("tiny"))
    return LLM(load_model(path, "float32"))


def test_the_compiler_runs_off_the_event_loop_and_its_refusal_is_a_400(llm):
    compiler = ThreadRecordingCompiler()
    engine = llm.async_engine()
    limits = ModelLimits("tiny", 1024, llm.target.config.vocab_size, False, 8)
    app, _ = build_app(engine, llm.tokenizer, limits, compiler=compiler)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def post(extra: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            return await http.post("/v1/chat/completions", json={**body, **extra})

    try:
        loop_thread = threading.current_thread()
        ok = asyncio.run(post({"response_format": {"type": "json_object"}}))
        refused = asyncio.run(post({"structured_outputs": {"regex": "refuse me"}}))
        plain = asyncio.run(post({}))
    finally:
        engine.shutdown(0)
    assert ok.status_code == 200 and plain.status_code == 200, (ok.text, plain.text)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "structured_outputs"
    assert "lookaheads" in refused.json()["error"]["message"]
    assert [kind for kind, _ in compiler.calls] == ["json_object", "regex"]
    assert all(thread is not loop_thread for _, thread in compiler.calls)
