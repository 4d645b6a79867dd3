"""`EngineClient`: the async engine and the replica pool implement it with the same
signatures; an LLM creates and tracks its AsyncEngine (one at a time, calls run here again
after its shutdown); the app's `/health` follows the engine's `health()`."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import pytest

from specserve.clients.async_engine import AsyncEngine
from specserve.clients.client import EngineClient
from specserve.llm import LLM
from specserve.sampling.params import SamplingParams
from specserve.server.app import build_app
from specserve.server.preparation import ModelLimits
from specserve.server.replicas.pool import ReplicaPool
from specserve.weights.loader import load_model
from tests import tiny

METHODS = ("stream", "abort", "stats", "health", "shutdown")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=5), tmp_path_factory.mktemp("m"))
    return load_model(path, "float32", weights="int8")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("impl", [AsyncEngine, ReplicaPool])
def test_implementations_have_the_protocols_methods_and_parameters(impl):
    for name in METHODS:
        expected = list(inspect.signature(getattr(EngineClient, name)).parameters)
        got = list(inspect.signature(getattr(impl, name)).parameters)
        assert got == expected, (impl.__name__, name)
    assert inspect.isasyncgenfunction(impl.stream)


def test_the_llm_tracks_its_async_engine_and_runs_calls_here_after_its_shutdown(model):
    llm = LLM(model)
    reference = llm.generate("the cat", greedy(6))[0].outputs[0].token_ids
    engine = llm.async_engine()
    assert isinstance(engine, EngineClient) and engine.health() and not engine.stopped
    with pytest.raises(RuntimeError, match="already runs"):
        llm.async_engine()
    assert llm.generate("the cat", greedy(6))[0].outputs[0].token_ids == reference
    engine.shutdown(timeout=10)
    assert engine.stopped and not engine.health()
    assert llm.generate("the cat", greedy(6))[0].outputs[0].token_ids == reference  # here
    again = llm.async_engine()  # a new one may run it now
    try:
        assert again is not engine and again.health()
        assert llm.generate("the cat", greedy(6))[0].outputs[0].token_ids == reference
    finally:
        again.shutdown(timeout=10)


def test_from_llm_still_gives_the_llms_async_engine(model):
    llm = LLM(model)
    engine = AsyncEngine.from_llm(llm)
    try:
        with pytest.raises(RuntimeError, match="already runs"):
            llm.async_engine()
    finally:
        engine.shutdown(timeout=10)


def test_health_is_503_once_the_engine_cannot_serve(model):
    llm = LLM(model)
    engine = llm.async_engine()
    limits = ModelLimits("tiny", llm.engine.config.max_model_len, llm.target.config.vocab_size, False)
    app, _ = build_app(engine, llm.tokenizer, limits)

    async def health() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health")

    try:
        ok = asyncio.run(health())
        assert ok.status_code == 200 and ok.json()["status"] == "ok"
    finally:
        engine.shutdown(timeout=10)  # its thread ends: it serves no more
    gone = asyncio.run(health())
    assert gone.status_code == 503 and gone.json()["status"] == "unhealthy"
