"""The prefill path's dense weights come from the file's own dequantization (the `gguf`
package's), not from the int4 repack: a quantized model's `dense_weights` equal, bit for bit,
what `gguf.quants.dequantize` gives for the file's blocks (llama's Q/K rows unpermuted), stacked
as the layer stacks them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from specserve.weights.loader import load_model
from tests import tiny


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_models_dense_weights_are_the_gguf_packages_dequantization(tmp_path, arch):
    hf_model = tiny.build_hf_model(arch, hidden_size=256, intermediate_size=512)
    gguf_path, _ = tiny.write_gguf_pair(hf_model, arch, {"default": T.Q4_K, "ffn": T.Q6_K},
                                        tmp_path / "m.gguf", tmp_path / "hf")
    # write_gguf_pair loads gguf.quants.dequantize's values (unpermuted) into hf_model
    state = hf_model.state_dict()
    loaded = load_model(gguf_path, "float32", weights="int4")
    stacks = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
              "down": ("mlp.down_proj",)}
    for layer in range(hf_model.config.num_hidden_layers):
        for attr, names in stacks.items():
            expected = torch.cat([state[f"model.layers.{layer}.{n}.weight"] for n in names])
            got = loaded.model.dense_weights(layer, attr)
            assert got.dtype == torch.float32
            assert torch.equal(got, expected), (layer, attr)


def test_an_hf_directory_quantized_at_load_keeps_its_tensors_as_the_dense_source(tmp_path):
    hf_model = tiny.build_hf_model("qwen2")
    path = tiny.save_hf_dir(hf_model, tmp_path / "hf")
    loaded = load_model(path, "float32", weights="int4")
    state = hf_model.state_dict()
    assert torch.equal(loaded.model.dense_weights(1, "gate_up"),
                       torch.cat([state["model.layers.1.mlp.gate_proj.weight"],
                                  state["model.layers.1.mlp.up_proj.weight"]]))
    assert load_model(path, "float32", weights="float32").model.dense_weights is None
