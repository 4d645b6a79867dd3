"""Fixtures of the weight cache's tests: a private cache, and a count of repacks."""

from __future__ import annotations

import pytest

from specserve import kernels
from specserve.weights import loader, quant


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private `$SPECSERVE_CACHE`; returns its weights directory."""
    assert kernels.qmatmul() is not None, "these tests need the native kernels (AVX2)"
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))  # kernels: already loaded
    return tmp_path / "cache" / "weights"


@pytest.fixture
def repacks(monkeypatch):
    """Counts the projection tensors repacked from a file (its own blocks, or quantized anew)
    and the float weights quantized: a load from the cache makes none."""
    calls = []

    def counting(original):
        def count(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)
        return count

    monkeypatch.setattr(quant, "quantize_native", counting(quant.quantize_native))
    monkeypatch.setattr(loader, "_part", counting(loader._part))
    return calls
