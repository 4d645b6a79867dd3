"""The Python API: `LLM(model=..., speculative_config=...)`, `generate`, `chat`."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from specserve.engine.engine import EngineConfig, LLMEngine
from specserve.engine.outputs import RequestOutput
from specserve.engine.runner import ModelRunner
from specserve.models.loader import LoadedModel, load_model
from specserve.models.registry import DEFAULT_TARGET
from specserve.models.tokenizer import Tokenizer
from specserve.sampling.params import SamplingParams
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.draft_model import DraftModelDrafter
from specserve.speculative.drafter import Drafter
from specserve.speculative.ngram import NgramDrafter


class LLM:
    """E.g. `LLM("qwen2.5-coder-1.5b", speculative_config={"method": "draft_model",
    "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4})`."""

    def __init__(self, model: str | Path | LoadedModel = DEFAULT_TARGET, dtype: str = "bfloat16",
                 speculative_config: dict | SpeculativeConfig | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 4096,
                 draft: LoadedModel | None = None, weights: str = "bf16") -> None:
        self.spec = SpeculativeConfig.from_dict(speculative_config)
        self.weights = weights
        self.target = model if isinstance(model, LoadedModel) else load_model(model, dtype, weights)
        max_len = min(max_model_len, self.target.config.max_position)
        config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_len)
        self.draft = draft
        drafter = self._build_drafter(dtype, config) if self.spec else None
        runner = ModelRunner(self.target.model, max_num_seqs, max_len)
        self.engine = LLMEngine(runner, self.target.tokenizer, config, self.spec, drafter)
        if self.spec is not None and self.spec.policy_name == "cost_aware" \
                and self.spec.num_speculative_tokens != 0:
            self.engine.calibrate()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.target.tokenizer

    def _build_drafter(self, dtype: str, config: EngineConfig) -> Drafter:
        spec = self.spec
        if spec.method == "ngram":
            return NgramDrafter(spec.num_speculative_tokens if spec.num_speculative_tokens >= 0
                                else spec.max_k, spec.prompt_lookup_max, spec.prompt_lookup_min)
        if self.draft is None:
            self.draft = load_model(spec.model, spec.draft_dtype or dtype, self.weights)
        check_same_vocabulary(self.target.tokenizer, self.draft.tokenizer)
        runner = ModelRunner(self.draft.model, config.max_num_seqs, config.max_model_len)
        return DraftModelDrafter(runner, self.target.config.vocab_size)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        ids = []
        for prompt, p in zip(prompts, params):
            text = prompt if isinstance(prompt, str) else None
            ids.append(self.engine.add_request(self._encode(prompt), p, prompt=text))
        return self._run(ids)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _run(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        wanted = list(request_ids)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished() and len(done) < len(wanted):
            for out in self.engine.step():
                done[out.request_id] = out
        return [done[r] for r in wanted]

    def metrics(self) -> dict:
        return self.engine.metrics.as_dict()


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer) -> None:
    """Refuse a draft whose tokenizer differs from the target's. Different padded vocabulary
    sizes of the same tokenizer are fine: only real tokens are compared."""
    t_vocab, d_vocab = target.backend.get_vocab(), draft.backend.get_vocab()
    t_by_id = {i: t for t, i in t_vocab.items()}
    d_by_id = {i: t for t, i in d_vocab.items()}
    for i in range(min(len(t_by_id), len(d_by_id))):
        if t_by_id.get(i) != d_by_id.get(i):
            raise ValueError(f"draft model's vocabulary differs from the target's: token id {i} is "
                             f"{d_by_id.get(i)!r} in the draft and {t_by_id.get(i)!r} in the target; "
                             "speculative decoding needs a draft with the same tokenizer")
