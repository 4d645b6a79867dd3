"""Shared fixtures: tiny random models and the real-model cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import tiny

# Tiny models: one thread avoids OpenMP oversubscription on a busy 2-core machine; the
# real-model tests raise it with the `two_threads` fixture.
torch.set_num_threads(1)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory, tiny_arch):
    """(transformers model, directory) of a tiny random checkpoint of `tiny_arch`."""
    model = tiny.build_hf_model(tiny_arch)
    path = tiny.save_hf_dir(model, tmp_path_factory.mktemp(f"hf-{tiny_arch}"))
    return model, path


@pytest.fixture(scope="module")
def int8_pair(tmp_path_factory):
    """(target, draft): the speculative tests' tiny int8 pair (`tiny.load_int8_pair`)."""
    return tiny.load_int8_pair(tmp_path_factory)


def real_model_path(alias: str) -> Path:
    """The cached real model, or a failure telling how to fetch it (never a skip)."""
    from specserve.hub.resolver import resolve_model

    try:
        return resolve_model(alias)
    except FileNotFoundError as e:
        pytest.fail(f"{e} — run `specserve download` (the README's setup command does)")


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(previous)
