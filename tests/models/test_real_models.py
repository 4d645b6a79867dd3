"""The real models from the cache (filled by the README's setup command) against
`transformers` on the same GGUF files, in float32."""

from __future__ import annotations

import pytest
import torch

from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams
from tests.conftest import real_model_path

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a haiku about speculative decoding."},
            {"role": "assistant", "content": "Drafts race ahead; the verifier nods."},
            {"role": "user", "content": "Another one, please."}]
N_TOKENS = 32


def hf_reference(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_greedy_continuation_equals_transformers(alias, two_threads):
    path = real_model_path(alias)
    ours = load_model(path, "float32", weights="float32")
    hf_model, hf_tok = hf_reference(path)
    ids = ours.tokenizer.encode(PROMPT)
    assert ids == hf_tok(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS, do_sample=False,
                                min_new_tokens=N_TOKENS)[0, len(ids):].tolist()
    del hf_model
    got = LLM(ours).generate(ids, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True))
    assert got[0].token_ids == ref


@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-1.5b"])
def test_chat_template_renders_as_transformers(alias):
    import transformers

    path = real_model_path(alias)
    from specserve.weights.gguf_loader import open_gguf, read_metadata
    from specserve.models.tokenizer import from_gguf_metadata

    ours = from_gguf_metadata(read_metadata(open_gguf(path)))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for add in (True, False):
        expected = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add) == expected
    text = ours.apply_chat_template(MESSAGES)
    assert ours.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
