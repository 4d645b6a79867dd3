"""Peer engines on the same GGUF weights, dtype, prompts, token counts and seeds:
Hugging Face `transformers` (target-only, assisted generation with the same draft, prompt
lookup) and, where installed, `llama-cpp-python` and OpenVINO GenAI (`openvino-genai`)
(target-only, prompt lookup)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

# our configurations each peer configuration is compared with, the first one present in the run
MATCHES = {"target only": ("target only",), "assisted (draft model)": ("fixed 4", "cost_aware"),
           "prompt lookup": ("ngram cost-aware", "ngram k=4")}


def run_transformers(target: Path, draft: Path | None, dtype: str, prompts: dict[str, list[int]],
                     temperatures: list[float], max_tokens: int, repeats: int, seeds: int) -> list[dict]:
    import transformers

    torch_dtype = getattr(torch, dtype)

    def load(path: Path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch_dtype).eval()

    start = time.perf_counter()
    model = load(target)
    load_s = time.perf_counter() - start
    assistant = load(draft) if draft is not None else None
    modes = {"target only": {}, "prompt lookup": {"prompt_lookup_num_tokens": 4}}
    if assistant is not None:
        modes["assisted (draft model)"] = {"assistant_model": assistant}
    rows = []
    for workload, ids in prompts.items():
        x = torch.tensor([ids])
        for t in temperatures:
            sample = {"do_sample": True, "temperature": t, "top_k": 0, "top_p": 1.0} if t > 0 else \
                {"do_sample": False}
            for mode, extra in modes.items():
                def gen(inputs, n, seed=0, streamer=None):
                    torch.manual_seed(seed)
                    with torch.inference_mode():
                        return model.generate(inputs, max_new_tokens=n, min_new_tokens=n,
                                              streamer=streamer, **sample, **extra)
                gen(x[:, :16], 4)  # warm-up on a short prefix
                clocks = []
                for s in range(seeds if t > 0 else 1):
                    for _ in range(repeats):
                        clocks.append(_Clock())
                        gen(x, max_tokens, s, clocks[-1])
                rows.append({"engine": "transformers", "config": mode, "temperature": t,
                             "workload": workload,
                             "median_e2e_s": statistics.median(c.e2e for c in clocks),
                             "ttft_s": statistics.median(c.ttft for c in clocks),
                             "decode_tokens_per_s": statistics.median(c.decode_rate for c in clocks),
                             "matches": MATCHES[mode], "load_s": load_s})
    return rows


class _Clock:
    """A `transformers` streamer that notes when each token arrives (the first `put` is the
    prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens = 0
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens += value.numel()

    def end(self) -> None:
        self.stop = time.perf_counter()

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.stop - self.start

    @property
    def decode_rate(self) -> float:
        return (self.tokens - 1) / max(1e-9, self.times[-1] - self.times[0])


def run_llama_cpp(target: Path, prompts: dict[str, list[int]], max_tokens: int, repeats: int,
                  threads: int, eos_ids: frozenset[int] = frozenset()) -> list[dict]:
    """llama.cpp through `llama-cpp-python` (optional): greedy target-only and prompt lookup.
    Each timed call starts from an empty cache (full prefill, like ours) and streams, so TTFT
    and the decode rate are measured the same way as ours; EOS is banned (EOS ignored)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    ban = {int(t): float("-inf") for t in eos_ids}
    n_ctx = max(len(ids) for ids in prompts.values()) + max_tokens + 64
    rows = []
    # with a draft, llama-cpp-python keeps logits for every position; it sizes that buffer
    # from the `logits_all` argument, so it must be passed explicitly
    for mode, extra in {"target only": {}, "prompt lookup": {
            "draft_model": LlamaPromptLookupDecoding(num_pred_tokens=4), "logits_all": True}}.items():
        start = time.perf_counter()
        llm = Llama(model_path=str(target), n_ctx=n_ctx, n_threads=threads, n_batch=512,
                    verbose=False, **extra)
        load_s = time.perf_counter() - start
        for workload, ids in prompts.items():
            def gen(n):
                llm.reset()  # no prompt reuse between calls
                start = time.perf_counter()
                times = [time.perf_counter() for _ in llm.create_completion(
                    ids, max_tokens=n, temperature=0.0, top_k=1, logit_bias=ban or None,
                    stream=True)]
                return start, times
            gen(8)  # warm-up
            clocks = [gen(max_tokens) for _ in range(repeats)]
            rows.append({"engine": "llama.cpp", "config": mode, "temperature": 0.0,
                         "workload": workload,
                         "median_e2e_s": statistics.median(t[-1] - s for s, t in clocks),
                         "ttft_s": statistics.median(t[0] - s for s, t in clocks),
                         "decode_tokens_per_s": statistics.median(
                             (len(t) - 1) / max(1e-9, t[-1] - t[0]) for _, t in clocks),
                         "output_tokens": statistics.median(len(t) for _, t in clocks),
                         "matches": MATCHES[mode], "load_s": load_s})
    return rows


def run_openvino(target: Path, prompts: dict[str, list[int]], max_tokens: int, repeats: int,
                 threads: int) -> list[dict]:
    """OpenVINO GenAI (optional, `pip install openvino-genai`) on the same GGUF file: greedy
    target-only and prompt lookup (4 tokens, n-grams up to 3), `threads` inference threads,
    prefix caching off so every call prefills its whole prompt, EOS ignored. Token arrival
    times come from a streamer, as ours and llama.cpp's do."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    class Clock(ov_genai.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.start = time.perf_counter()
            self.times: list[float] = []
            self.tokens = 0

        def write(self, token):
            self.times.append(time.perf_counter())
            self.tokens += len(token) if isinstance(token, list) else 1
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            self.stop = time.perf_counter()

    rows = []
    for mode, extra in {"target only": {}, "prompt lookup": {"prompt_lookup": True}}.items():
        scheduler = ov_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        start = time.perf_counter()
        pipe = ov_genai.LLMPipeline(str(target), "CPU", INFERENCE_NUM_THREADS=threads,
                                    scheduler_config=scheduler, **extra)
        load_s = time.perf_counter() - start
        for workload, ids in prompts.items():
            def gen(n: int) -> Clock:
                x = np.array([ids], dtype=np.int64)  # [1, prompt]
                inputs = ov_genai.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x)))
                config = ov_genai.GenerationConfig()
                config.max_new_tokens = config.min_new_tokens = n
                config.ignore_eos, config.do_sample = True, False
                if extra:
                    config.num_assistant_tokens, config.max_ngram_size = 4, 3
                clock = Clock()
                pipe.generate(inputs, config, clock)
                return clock

            gen(8)  # warm-up
            clocks = [gen(max_tokens) for _ in range(repeats)]
            rows.append({"engine": "openvino", "config": mode, "temperature": 0.0,
                         "workload": workload,
                         "median_e2e_s": statistics.median(c.stop - c.start for c in clocks),
                         "ttft_s": statistics.median(c.times[0] - c.start for c in clocks),
                         "decode_tokens_per_s": statistics.median(
                             (c.tokens - 1) / max(1e-9, c.times[-1] - c.times[0]) for c in clocks),
                         "output_tokens": statistics.median(c.tokens for c in clocks),
                         "matches": MATCHES[mode], "load_s": load_s})
        pipe = None  # freed before the next mode's pipeline loads
    return rows


def attach_ratios(peers: list[dict], ours: list[dict]) -> None:
    for p in peers:
        same = [r for r in ours if r["workload"] == p["workload"]
                and r["temperature"] == p["temperature"]]
        mine = next((r for name in p["matches"] for r in same if r["config"] == name), None)
        p["matched"] = mine["config"] if mine else None
        p["ours_over_theirs"] = (mine["decode_tokens_per_s"] / p["decode_tokens_per_s"]) if mine else None
        p["ttft_ours_over_theirs"] = mine["median_ttft_s"] / p["ttft_s"] if mine else None
        p["e2e_speedup"] = p["median_e2e_s"] / mine["median_e2e_s"] if mine else None
