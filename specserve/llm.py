"""The Python API: `LLM(model=..., speculative_config=...)`, `generate`, `chat`.

A call is all or nothing: every input is validated before anything is queued, and an
exception or interrupt inside a call aborts exactly that call's requests, leaving the object
ready for the next call. Calls from several threads on one `LLM` are serialized (one runs at a
time, each gets its own results) — unless `llm.async_engine()` runs the engine on a thread: then
calls go through that AsyncEngine and run concurrently with each other and with its streams,
until it shuts down. The LLM creates and tracks its AsyncEngine; the AsyncEngine knows nothing
of the LLM.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

from specserve.clients.async_engine import AsyncEngine
from specserve.config import PAIR_DEFAULT, LLMConfig
from specserve.engine.engine import LLMEngine
from specserve.engine.outputs import RequestOutput
from specserve.engine.runner import build_runners, kv_positions
from specserve.inputs import check_conversations, check_draft, check_generate_inputs
from specserve.weights.loader import LoadedModel, load_model
from specserve.hub.registry import DEFAULT_TARGET
from specserve.models.tokenizer import Tokenizer, check_same_vocabulary
from specserve.sampling.params import SamplingParams, require_bool
from specserve.speculative.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from specserve.speculative.sources import build_controller

log = logging.getLogger("specserve.engine")
MIN_DEFAULT_CONTEXT = 4096  # the default context where the default KV budget is smaller


class LLM:
    """E.g. `LLM("qwen2.5-coder-1.5b", speculative_config={"method": "draft_model",
    "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4})`. `LLM()` (the default
    target, no `speculative_config`) speculates as `serve` does with the default pair:
    hybrid with the default draft, cost-aware k; `speculative_config=None` decodes plainly,
    and another model speculates only when asked (`default_speculation.for_llm`)."""

    def __init__(self, model: str | Path | LoadedModel = DEFAULT_TARGET, dtype: str = "auto",
                 speculative_config: dict | SpeculativeConfig | None = PAIR_DEFAULT, *,
                 draft: LoadedModel | None = None, weights: str = "auto",
                 defer_startup: bool = False, **engine_options: object) -> None:
        """`engine_options`: any `EngineConfig` field by name (`max_num_seqs=8`,
        `max_model_len` (None: the model's trained context, bounded by the KV budget),
        `kv_cache_memory`, `max_num_batched_tokens=256`,
        `enable_prefix_caching=True`, `kv_cache_dtype="auto"`), so a new engine option is a
        keyword here with nothing else to edit. Everything is validated, as one `LLMConfig`,
        before anything loads. (Deprecation: the arguments after `speculative_config` are
        keyword-only now; they were never documented positionally.)

        The start-up work (the draft's restricted head and the cost model's timed passes, which
        run kernels; the tokenizer's text-only copy, 0.3 s, for a serving or speculative
        engine) runs here, on the thread that builds the LLM (the one that calls
        `generate` after); `defer_startup=True` leaves it to the thread that first steps the
        engine (`async_engine()`'s, when serving), so that one thread runs every kernel (see
        `LLMEngine.run_startup`)."""
        self.config = LLMConfig.from_kwargs(model, dtype, speculative_config, weights,
                                            **engine_options)
        check_draft(draft)
        self.spec, self.weights = self.config.speculative, weights
        self.target = model if isinstance(model, LoadedModel) else load_model(model, dtype, weights)
        self.draft = draft
        uses_draft = self.spec is not None and self.spec.uses_draft_model
        if uses_draft:
            self._load_draft(dtype)
        max_len = self._context(uses_draft)
        config = replace(self.config.engine, max_model_len=max_len)
        # KV blocks by budget, the same number for the target and the draft; one sequence of
        # max_model_len positions plus a round's drafts must fit
        runner, draft_runner = build_runners(
            self.target.model, self.draft.model if uses_draft else None,
            config.kv_cache_memory, config.block_size, max_len + MAX_SPECULATIVE_TOKENS + 1,
            config.kv_cache_dtype)
        keep = None
        if uses_draft:  # a restricted draft head keeps the draft's added (special) tokens
            tok = self.draft.tokenizer
            keep = [*tok.backend.get_added_tokens_decoder(), *tok.eos_token_ids]
        spec = None if self.spec is None else build_controller(
            self.spec, draft_runner, self.target.config.vocab_size,
            config.max_num_batched_tokens, max_len, config.enable_prefix_caching, runner, keep)
        # for a server's chat and the suffix drafter's views: the tokenizer's text-only copy
        self.engine = LLMEngine(runner, runner.block_manager(config.enable_prefix_caching),
                                self.target.tokenizer, config, spec,
                                prepare_tokenizer=defer_startup or spec is not None)
        if not defer_startup:
            self.engine.run_startup()
        self._lock = threading.Lock()  # one generate/chat call drives the engine at a time
        self._driver = None  # an AsyncEngine running the engine: calls go through it

    def _context(self, uses_draft: bool) -> int:
        """The context length: `max_model_len` as given, or the model's trained context; with
        none given, bounded by what the KV budget holds for one sequence (a round's drafts
        included; the default budget on a machine short of memory still gives
        `MIN_DEFAULT_CONTEXT`, as it gives one such sequence its blocks). Either way no longer than
        the model's trained context."""
        engine, trained = self.config.engine, self.target.config.max_position
        if engine.max_model_len is not None:
            return min(engine.max_model_len, trained)
        draft = self.draft.model if uses_draft else None
        held = kv_positions(self.target.model, draft, engine.kv_cache_memory, engine.block_size,
                            engine.kv_cache_dtype) - MAX_SPECULATIVE_TOKENS - 1
        floor = 0 if engine.kv_cache_memory is not None else MIN_DEFAULT_CONTEXT
        length = max(min(trained, held), min(trained, floor))
        log.info("specserve: context %d tokens (trained for %d%s)", length, trained,
                 f"; the KV budget holds {held} for one sequence" if held < trained else "")
        return length

    @classmethod
    def from_config(cls, config: LLMConfig, draft: LoadedModel | None = None,
                    defer_startup: bool = False) -> LLM:
        """The LLM of a configuration tree (e.g. `LLMConfig.from_args` of a command)."""
        return cls(**config.kwargs(), draft=draft, defer_startup=defer_startup)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.target.tokenizer

    def _load_draft(self, dtype: str) -> None:
        if self.draft is None:
            weights = self.spec.draft_weights
            self.draft = load_model(self.spec.model, self.spec.draft_dtype or dtype,
                                    weights or self.weights, draft=weights is None)
        check_same_vocabulary(self.target.tokenizer, self.draft.tokenizer)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs come back in prompt order."""
        return self._generate(self._prepare(prompts, sampling_params))

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.
        `tools`: the OpenAI tool list, shown to the template as `tools` (the output is not
        parsed for calls; the server does that)."""
        conversations = check_conversations(messages)
        require_bool("add_generation_prompt", add_generation_prompt)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, tools=tools)
                   for c in conversations]
        return self._generate(self._prepare(prompts, sampling_params))

    def _prepare(self, prompts, sampling_params) -> list[tuple[list[int], SamplingParams, str | None]]:
        """Check, encode and validate every prompt of a call; raises before anything is queued."""
        batch, params = check_generate_inputs(prompts, sampling_params)
        requests = []
        for i, (prompt, p) in enumerate(zip(batch, params)):
            ids = self._encode(prompt)
            try:
                self.engine.check_request(ids, p)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
            requests.append((ids, p, prompt if isinstance(prompt, str) else None))
        return requests

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def async_engine(self, step_timeout: float | None = None) -> AsyncEngine:
        """An AsyncEngine that runs this LLM's engine on its thread, started once no call is in
        flight; `generate`/`chat` go through it (concurrently) until it is shut down, then run
        here again. `step_timeout`: seconds one step may take before the engine counts as dead
        (None: no watchdog)."""
        with self._lock:
            if self._driver is not None and not self._driver.stopped:
                raise RuntimeError("an AsyncEngine already runs this LLM's engine; shut it "
                                   "down first")
            self._driver = AsyncEngine(self.engine, step_timeout)
            return self._driver

    def _generate(self, requests: list[tuple[list[int], SamplingParams, str | None]]
                  ) -> list[RequestOutput]:
        """Run a call's requests: through the AsyncEngine that runs the engine, if any
        (concurrently with other calls), else here, one call at a time."""
        while True:
            driver = self._driver
            if driver is not None and not driver.stopped:
                return driver.generate(requests)
            with self._lock:
                if self._driver is driver:  # (no AsyncEngine started while this call waited)
                    self._driver = None
                    return self._run_here(requests)

    def _run_here(self, requests: list[tuple[list[int], SamplingParams, str | None]]
                  ) -> list[RequestOutput]:
        """Queue the call's requests and step the engine until all of them finished, keeping
        only their own outputs. On any exception or interrupt, abort the ones still running."""
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt_ids, params, text in requests:
                ids.append(self.engine.add_request(prompt_ids, params, prompt=text))
            wanted = set(ids)
            while len(done) < len(ids):
                if not self.engine.has_unfinished():
                    raise RuntimeError("the engine went idle with requests unfinished")
                for delta in self.engine.step():
                    if delta.finished and delta.request_id in wanted:
                        if delta.error is not None:
                            raise delta.error
                        done[delta.request_id] = delta.output
        except BaseException:
            self._abort([r for r in ids if r not in done])
            raise
        return [done[r] for r in ids]

    def _abort(self, request_ids: list[str]) -> None:
        """Abort requests and step until the engine has let go of them."""
        for rid in request_ids:
            self.engine.abort_request(rid)
        try:
            while any(r in self.engine.requests for r in request_ids):
                self.engine.step()
        except Exception:  # noqa: BLE001 - the caller re-raises the original failure
            pass

    def metrics(self) -> dict:
        return self.engine.metrics.as_dict()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes (the next request prefills from scratch)."""
        return self.engine.reset_prefix_cache()

    def clear_caches(self) -> None:
        """Forget the cached prompt prefixes and the earlier outputs the suffix drafter
        keeps: the next request is served as by a fresh engine (benchmarks use it so that
        no call drafts from another's answer)."""
        self.engine.reset_prefix_cache()
        if self.engine.spec is not None:
            self.engine.spec.clear_cache()
