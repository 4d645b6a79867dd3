"""`LLM.chat(..., tools=...)`: the OpenAI tool list reaches the model's chat template, as vLLM's
`LLM.chat` does (the output is not parsed for calls; the server does that)."""

from __future__ import annotations

import json

from specserve.llm import LLM
from specserve.sampling.params import SamplingParams
from specserve.weights.loader import load_model
from tests import tiny

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_chat_shows_the_tools_to_the_template_and_only_when_given(tmp_path):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2"), tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    shows = "{% if tools %}tools={{ tools | tojson }}\n{% endif %}"
    config["chat_template"] = shows + tiny.CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(load_model(path, "float32"))
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=1, temperature=0)
    (with_tools,) = llm.chat(messages, params, tools=[TOOL])
    (without,) = llm.chat(messages, params)
    shown = llm.tokenizer.decode(with_tools.prompt_token_ids)
    assert shown.startswith(f"tools={json.dumps([TOOL])}\n")
    assert shown.endswith(llm.tokenizer.decode(without.prompt_token_ids))
    assert "tools=" not in llm.tokenizer.decode(without.prompt_token_ids)
