"""A GGUF file whose metadata lies about a size is refused before anything is allocated: every
size the metadata states (embedding length, block count, head counts, key length, feed-forward
length, vocabulary, context length) is checked against the tensors' shapes and sane bounds,
with an error naming the field, and no tensor is read first."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from specserve.weights import gguf_loader
from specserve.weights.loader import load_model
from tests import tiny

ARCH = "qwen2"
# (metadata key after "qwen2.", hostile value): insane values and plausible lies; the tiny model
# has hidden 64, 2 layers, 4 heads of 16, 2 KV heads, feed-forward 128, 112 tokens
HOSTILE = [
    ("embedding_length", 1 << 30), ("embedding_length", 0), ("embedding_length", 128),
    ("block_count", 1 << 30), ("block_count", 0), ("block_count", 3), ("block_count", 1),
    ("attention.head_count", 0), ("attention.head_count", 1 << 30),
    ("attention.head_count", 8), ("attention.head_count", 3),
    ("attention.head_count_kv", 0), ("attention.head_count_kv", 1 << 30),
    ("attention.head_count_kv", 1),
    ("attention.key_length", 0), ("attention.key_length", 1 << 30),
    ("attention.key_length", 32),
    ("feed_forward_length", 1 << 30), ("feed_forward_length", 0), ("feed_forward_length", 96),
    ("vocab_size", 1 << 30), ("vocab_size", 0), ("vocab_size", 100),
    ("context_length", 0), ("context_length", (1 << 32) - 1),
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny qwen2 GGUF file that states its key length and vocabulary size too."""
    root = tmp_path_factory.mktemp("sizes")
    model = tiny.build_hf_model(ARCH, hidden_size=64, intermediate_size=128)

    def extra(writer):
        writer.add_key_length(16)
        writer.add_vocab_size(tiny.VOCAB)

    path, _ = tiny.write_gguf_pair(model, ARCH, {"default": T.Q8_0}, root / "m.gguf",
                                   root / "hf", extra=extra)
    return path.read_bytes()


def patched(tmp_path, data: bytes, key: str, value: int):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    field = GGUFReader(path, "r+").fields[f"{ARCH}.{key}"]
    part = field.parts[field.data[0]]
    part[0] = np.array(value).astype(part.dtype)  # in place, in the field's own type
    return path


def test_the_honest_file_loads(tiny_gguf, tmp_path):
    path = tmp_path / "honest.gguf"
    path.write_bytes(tiny_gguf)
    loaded = load_model(path, weights="float32")
    assert loaded.config.hidden_size == 64 and loaded.config.vocab_size == tiny.VOCAB


@pytest.mark.parametrize("key,value", HOSTILE, ids=[f"{k}={v}" for k, v in HOSTILE])
def test_a_size_that_lies_is_refused_naming_it_before_any_tensor_is_read(
        tiny_gguf, tmp_path, monkeypatch, key, value):
    path = patched(tmp_path, tiny_gguf, key, value)
    reads = []
    original = gguf_loader.dequantize
    monkeypatch.setattr(gguf_loader, "dequantize", lambda *a, **k: reads.append(1) or original(*a, **k))
    for weights in ("float32", "int4"):
        with pytest.raises(ValueError, match=f"{ARCH}.{key}"):
            load_model(path, weights=weights, weight_cache=False)
    assert reads == [], "a tensor was read before the sizes were checked"
