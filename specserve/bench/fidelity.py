"""How close each weight path is to the file: log-probabilities against the file's own model.

The reference is the GGUF file's model in float32: every tensor dequantized by the `gguf`
package (its `quants.dequantize`, not this package's decoder) and run on the float32 path.
On prompts of several kinds (`PROMPTS`), the reference continues each prompt greedily for
`tokens` tokens; every path is then fed the same tokens, prompt in one prefill pass and the
continuation one decode step at a time (teacher forcing), and at each continuation position
its log-probabilities are compared with the reference's:

- |Δlogp| over the reference's top-k tokens (mean, 99th percentile, max over all positions
  and prompts): how far a path moves the probabilities that matter;
- KL(reference ‖ path) per position (mean, max), and how often the two argmaxes agree.

A path is a `weights=` format ("int4", "bf16", "float32", "int8", "int4-all"; "int4@32": with
activations quantized per 32 inputs instead of `quant.ACT_BLOCK`), "torch-int4"
(PyTorch's packed int4 kernels, the fallback where the native ones cannot run: run in a
subprocess with `SPECSERVE_NO_NATIVE=1`), or "llama.cpp" (llama.cpp's own logits for the same
tokens, from `benchmarks/scripts/llama_cpp_logprobs.py` run by a Python that has
`llama_cpp`). `python -m specserve.bench.fidelity --help`; docs/fidelity.md reads the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.hub.resolver import resolve_model
from specserve.models import tokenizer as tok
from specserve.models.factory import build_model
from specserve.models.transformer import ForwardBatch, Transformer
from specserve.weights.gguf_file import GGUFFile
from specserve.weights.gguf_loader import (config_from_gguf, open_gguf, read_metadata,
                                           tensor_index, unpermute)
from specserve.weights.loader import load_model
from specserve.weights.quant import NativeLinear

# (kind, chat?, text): a prompt of each kind a model is asked to continue
PROMPTS = (
    ("code", False, 'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted '
                    'list."""\n'),
    ("chat", True, "Explain in two sentences why the sky is blue."),
    ("prose", False, "The old lighthouse keeper climbed the stairs one last time. "),
    ("math", True, "A train travels 120 km in 1.5 hours. What is its average speed? Show the "
                   "steps."),
    ("json", True, 'Give a JSON object with the fields "name", "age" and "city" for a '
                   'fictional person.'),
    ("french", False, "Le petit prince regarda les étoiles et dit : "),
)
PATHS = ("int4", "bf16", "float32", "int8", "int4-all", "torch-int4", "llama.cpp")
_CHUNK_BYTES = 1 << 26  # the gguf package dequantizes this much of a tensor at a time


@dataclass(frozen=True)
class Sequence:
    kind: str
    prompt: list[int]
    continuation: list[int]  # the reference's greedy tokens


# ---------------------------------------------------------------- the reference
def _gguf_dequantize(gguf_file: GGUFFile, tensor) -> torch.Tensor:
    """One tensor as the `gguf` package dequantizes it (float32, PyTorch shape)."""
    from gguf import quants

    raw = np.asarray(gguf_file.raw(tensor))  # [nbytes] uint8
    rows = int(np.prod(tensor.shape[:-1], dtype=np.int64)) if len(tensor.shape) > 1 else 1
    raw = raw.reshape(rows, -1)  # [rows, row bytes]
    step = max(1, _CHUNK_BYTES // max(1, raw.shape[1]))
    parts = [np.asarray(quants.dequantize(raw[i:i + step], tensor.qtype), dtype=np.float32)
             for i in range(0, rows, step)]
    return torch.from_numpy(np.concatenate(parts)).reshape(tensor.shape)


class _Dequantized(Mapping):
    """A GGUF file's tensors (Hugging Face names) dequantized by the `gguf` package when asked
    for, none of them kept: the model's fused projections (q/k/v, gate/up) are concatenated
    copies, so a dict of every tensor beside them held the float32 model one and a half times
    (9.7 GB for the 1.5B target) where this holds it once."""

    def __init__(self, gguf_file: GGUFFile, cfg) -> None:
        self._file, self._cfg = gguf_file, cfg
        self._index = tensor_index(gguf_file)

    def __getitem__(self, name: str) -> torch.Tensor:
        w = _gguf_dequantize(self._file, self._index[name])
        if self._cfg.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, self._cfg.num_heads)
        elif self._cfg.architecture == "llama" and name.endswith(("k_proj.weight",
                                                                  "k_proj.bias")):
            w = unpermute(w, self._cfg.num_kv_heads)
        return w

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def file_reference(path: Path) -> tuple[Transformer, tok.Tokenizer]:
    """The file's model in float32 from the `gguf` package's dequantization (llama's Q/K rows
    unpermuted, as llama.cpp's converter permuted them), each tensor dequantized as the model
    takes it (`_Dequantized`)."""
    gguf_file = open_gguf(path)
    meta = read_metadata(gguf_file)
    cfg = config_from_gguf(gguf_file, meta)
    if cfg.architecture not in ("llama", "qwen2", "qwen3", "gemma3"):
        raise ValueError(f"{path}: no float32 reference for {cfg.architecture} files here")
    return build_model(cfg, _Dequantized(gguf_file, cfg)), tok.from_gguf_metadata(meta)


def prompt_ids(tokenizer: tok.Tokenizer, chat: bool, text: str) -> list[int]:
    if chat and tokenizer.chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": text}])
    return tokenizer.encode(text)


# ---------------------------------------------------------------- log-probabilities
def _steps(model, prompt: list[int], feed: list[int] | None, n: int):
    """Yields (log-probabilities [vocab] float64, next token) at n positions: the prompt in one
    pass, then one token per pass: `feed`'s (teacher forcing) or, without, the argmax."""
    total = len(prompt) + n
    cache = model.new_pool(-(-total // 16), 16)
    table = list(range(-(-total // 16)))
    with torch.inference_mode():
        (logits,) = model.forward(ForwardBatch.paged([prompt], [0], [table]), cache, last_n=[1])
        for i in range(n):
            logp = torch.log_softmax(logits[-1].double(), dim=-1)  # [vocab]
            token = feed[i] if feed is not None else int(torch.argmax(logp))
            yield logp, token
            if i + 1 < n:
                (logits,) = model.forward(
                    ForwardBatch.paged([[token]], [len(prompt) + i], [table]), cache)


def greedy_rows(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The model's greedy continuation and its log-probabilities [n, vocab] (float32)."""
    tokens, rows = [], []
    for logp, token in _steps(model, prompt, None, n):
        tokens.append(token)
        rows.append(logp.float())
    return tokens, torch.stack(rows)


def forced_rows(model, seq: Sequence) -> torch.Tensor:
    """Log-probabilities [n, vocab] (float32) at each continuation position of `seq`."""
    return torch.stack([logp.float() for logp, _ in
                        _steps(model, seq.prompt, seq.continuation, len(seq.continuation))])


# ---------------------------------------------------------------- comparison
def compare(ref: torch.Tensor, test: torch.Tensor, k: int = 5) -> dict[str, np.ndarray]:
    """Per position: |Δlogp| of the reference's top-k tokens [n, k], KL(ref ‖ test) [n] and
    whether the argmaxes agree [n]; and where the path's own greedy text would part from the
    reference's (`split`: the first disagreement, n if none: teacher forcing feeds both the
    same tokens until there) with the reference's margin there (`margin`: its log-probability
    of its token less that of the path's; a tie is near 0)."""
    ref, test = ref.double(), test.double()
    top = ref.topk(k, dim=-1).indices  # [n, k]
    delta = (test.gather(-1, top) - ref.gather(-1, top)).abs()
    kl = (ref.exp() * (ref - test)).sum(-1).clamp_min(0)
    picks = test.argmax(-1)  # [n]
    agree = ref.argmax(-1) == picks
    split = int((~agree).nonzero()[0, 0]) if (~agree).any() else len(agree)
    margin = float(ref[split].max() - ref[split, picks[split]]) if split < len(agree) else None
    return {"delta": delta.numpy(), "kl": kl.numpy(), "agree": agree.numpy(), "split": split,
            "margin": margin}


def summarize(parts: list[dict[str, np.ndarray]]) -> dict[str, float]:
    delta = np.concatenate([p["delta"].ravel() for p in parts])
    kl = np.concatenate([p["kl"] for p in parts])
    agree = np.concatenate([p["agree"] for p in parts])
    return {"mean": float(delta.mean()), "p99": float(np.quantile(delta, 0.99)),
            "max": float(delta.max()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agree": float(agree.mean()), "values": int(delta.size)}


# ---------------------------------------------------------------- paths
def path_rows(model_path: Path, path: str, seqs: list[Sequence]) -> list[torch.Tensor]:
    """Each sequence's log-probabilities through `path` (a `weights=` format, in-process;
    "FORMAT@N": with activations quantized per N inputs, `NativeLinear.with_act_block`)."""
    model = load_path(model_path, path)
    return [forced_rows(model, s) for s in seqs]


def with_act_block(model: Transformer, block: int) -> None:
    """Every native projection of `model` with activations quantized per `block` inputs."""
    def swap(lin):
        return lin.with_act_block(block) if isinstance(lin, NativeLinear) else lin

    for layer in model.layers:
        for attr in ("qkv", "o", "gate_up", "down"):
            setattr(layer, attr, swap(getattr(layer, attr)))
    model.lm_head = swap(model.lm_head)


def _subprocess_rows(cmd: list[str], seqs: list[Sequence], env: dict) -> list[torch.Tensor]:
    with tempfile.TemporaryDirectory() as d:
        spec, out = Path(d) / "seqs.json", Path(d) / "rows.npz"
        spec.write_text(json.dumps([asdict(s) for s in seqs]))
        subprocess.run([*cmd, "--sequences", str(spec), "--rows-out", str(out)], check=True,
                       env=env)
        with np.load(out) as z:
            return [torch.from_numpy(z[f"rows{i}"]) for i in range(len(seqs))]


def torch_int4_rows(model_path: Path, seqs: list[Sequence]) -> list[torch.Tensor]:
    """"int4" where the native kernels cannot run (PyTorch's packed int4, bf16 activations)."""
    cmd = [sys.executable, "-m", "specserve.bench.fidelity", "--model", str(model_path),
           "--rows-for", "int4"]
    return _subprocess_rows(cmd, seqs, {**os.environ, "SPECSERVE_NO_NATIVE": "1"})


def llama_cpp_rows(model_path: Path, seqs: list[Sequence], python: str,
                   threads: int) -> list[torch.Tensor]:
    """llama.cpp's log-probabilities for the same tokens, through `python` (one with
    `llama_cpp`) running benchmarks/scripts/llama_cpp_logprobs.py."""
    script = Path(__file__).resolve().parents[2] / "benchmarks/scripts/llama_cpp_logprobs.py"
    cmd = [python, str(script), "--model", str(model_path), "--threads", str(threads)]
    return _subprocess_rows(cmd, seqs, dict(os.environ))


def load_path(model_path: Path, path: str, loaded: dict | None = None) -> Transformer:
    """The model of `path` ("FORMAT" or "FORMAT@N"), sharing the weights of a format already
    in `loaded` (format → model)."""
    fmt, _, block = path.partition("@")
    loaded = {} if loaded is None else loaded
    if fmt not in loaded:
        loaded[fmt] = load_model(model_path, weights=fmt).model
    if not block:
        return loaded[fmt]
    model = copy.copy(loaded[fmt])
    model.layers = [copy.copy(layer) for layer in model.layers]
    with_act_block(model, int(block))
    return model


def pass_times(model_path: Path, paths: list[str], rounds: int = 7, prefill_rows: int = 256,
               decode_steps: int = 32) -> dict[str, dict[str, float]]:
    """Median seconds of a prefill pass of `prefill_rows` tokens and of a decode step after it,
    per path, the paths alternated within each round (their order rotating)."""
    loaded: dict = {}
    models = {p: load_path(model_path, p, loaded) for p in paths}
    ids = [(37 * i) % 5000 + 1000 for i in range(prefill_rows + decode_steps)]
    times = {p: {"prefill": [], "decode": []} for p in paths}
    blocks = -(-len(ids) // 16)
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            for p in paths[r % len(paths):] + paths[:r % len(paths)]:
                model = models[p]
                cache, table = model.new_pool(blocks, 16), list(range(blocks))
                start = time.perf_counter()
                model.forward(ForwardBatch.paged([ids[:prefill_rows]], [0], [table]), cache,
                              last_n=[1])
                prefill = time.perf_counter() - start
                start = time.perf_counter()
                for i in range(prefill_rows, len(ids)):
                    model.forward(ForwardBatch.paged([[ids[i]]], [i], [table]), cache)
                decode = (time.perf_counter() - start) / decode_steps
                if r:
                    times[p]["prefill"].append(prefill)
                    times[p]["decode"].append(decode)
    return {p: {"prefill_s": float(np.median(t["prefill"])),
                "decode_s": float(np.median(t["decode"])),
                "prefill_tok_s": prefill_rows / float(np.median(t["prefill"])),
                "decode_tok_s": 1 / float(np.median(t["decode"]))} for p, t in times.items()}


def run(model_path: Path, paths: list[str], tokens: int = 48, k: int = 5,
        llama_python: str | None = None, threads: int = 2) -> dict:
    """The fidelity report of `paths` on the file at `model_path` (see the module doc)."""
    unknown = [p for p in paths if p.partition("@")[0] not in PATHS]
    if unknown:
        raise ValueError(f"paths must be among {PATHS}, got {unknown}")
    if "llama.cpp" in paths and llama_python is None:
        raise ValueError("the llama.cpp path needs --llama-python (a Python with llama_cpp)")
    start = time.perf_counter()
    ref_model, tokenizer = file_reference(model_path)
    seqs, ref_rows = [], []
    for kind, chat, text in PROMPTS:
        prompt = prompt_ids(tokenizer, chat, text)
        continuation, rows = greedy_rows(ref_model, prompt, tokens)
        seqs.append(Sequence(kind, prompt, continuation))
        ref_rows.append(rows)
    del ref_model
    report = {"model": str(model_path), "tokens": tokens, "top_k": k, "paths": {},
              "sequences": [asdict(s) | {"text": tokenizer.decode(s.continuation)}
                            for s in seqs]}
    for path in paths:
        if path == "torch-int4":
            rows = torch_int4_rows(model_path, seqs)
        elif path == "llama.cpp":
            rows = llama_cpp_rows(model_path, seqs, llama_python, threads)
        else:
            rows = path_rows(model_path, path, seqs)
        parts = [compare(r, t, k) for r, t in zip(ref_rows, rows)]
        entry = summarize(parts)
        entry["by_kind"] = {s.kind: summarize([p])["mean"] for s, p in zip(seqs, parts)}
        # the token at which greedy text parts from the reference's (1-based; None: it does
        # not within `tokens`) and the reference's margin there (nats)
        entry["greedy_split"] = {s.kind: [p["split"] + 1 if p["split"] < tokens else None,
                                          p["margin"]] for s, p in zip(seqs, parts)}
        report["paths"][path] = entry
        print(f"{path:<10} {_line(entry)}", flush=True)
    report["seconds"] = time.perf_counter() - start
    return report


def _line(e: dict) -> str:
    return (f"mean {e['mean']:.4f}  p99 {e['p99']:.3f}  max {e['max']:.3f}  "
            f"KL {e['kl_mean']:.5f} (max {e['kl_max']:.4f})  top-1 {100 * e['top1_agree']:.1f}%")


def _split(entry: dict, kind: str) -> str:
    token, margin = entry.get("greedy_split", {}).get(kind, (None, None))
    return "—" if token is None else f"{token} ({margin:.3f})"


def markdown(report: dict) -> str:
    """The summary table, then where each path's greedy text parts from the reference's
    (token, the reference's margin there in nats; —: not within the tokens)."""
    kinds = [s["kind"] for s in report["sequences"]]
    head = ("| path | mean \\|Δlogp\\| top-{k} | p99 | max | mean KL | max KL | top-1 agree | "
            .format(k=report["top_k"]) + " | ".join(kinds) + " |")
    lines = [head, "|" + "---|" * (7 + len(kinds))]
    for path, e in report["paths"].items():
        lines.append(f"| {path} | {e['mean']:.4f} | {e['p99']:.3f} | {e['max']:.3f} | "
                     f"{e['kl_mean']:.5f} | {e['kl_max']:.4f} | {100 * e['top1_agree']:.1f}% | "
                     + " | ".join(f"{e['by_kind'][kd]:.4f}" for kd in kinds) + " |")
    lines += ["", "| greedy text parts at token (margin) | " + " | ".join(kinds) + " |",
              "|" + "---|" * (1 + len(kinds))]
    for path, e in report["paths"].items():
        lines.append(f"| {path} | " + " | ".join(_split(e, kd) for kd in kinds) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.bench.fidelity",
                                description="log-probabilities of each weight path against "
                                "the file's float32 dequantization (gguf package)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="alias or GGUF file")
    p.add_argument("--paths", default="int4,bf16,float32",
                   help=f"comma-separated, among {', '.join(PATHS)}")
    p.add_argument("--tokens", type=int, default=48, help="continuation tokens per prompt")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--llama-python", default=None,
                   help="a Python with llama_cpp, for the llama.cpp path")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=None, help="write fidelity.json/.md here")
    p.add_argument("--speed", action="store_true",
                   help="time the paths' prefill passes and decode steps instead (alternated)")
    p.add_argument("--rounds", type=int, default=7, help="--speed: rounds of every path")
    p.add_argument("--rows-for", default=None, help=argparse.SUPPRESS)  # a subprocess's part
    p.add_argument("--sequences", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    model_path = resolve_model(args.model)
    if args.rows_for is not None:
        seqs = [Sequence(**s) for s in json.loads(args.sequences.read_text())]
        rows = path_rows(model_path, args.rows_for, seqs)
        np.savez(args.rows_out, **{f"rows{i}": r.numpy() for i, r in enumerate(rows)})
        return 0
    paths = [s for s in args.paths.split(",") if s]
    if args.speed:
        speed = pass_times(model_path, paths, args.rounds)
        for path, t in speed.items():
            print(f"{path:<10} prefill {t['prefill_tok_s']:.1f} tok/s, decode "
                  f"{t['decode_tok_s']:.2f} tok/s", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "speed.json").write_text(json.dumps(
                {"model": str(model_path), "threads": torch.get_num_threads(), "paths": speed},
                indent=1))
        return 0
    report = run(model_path, paths, args.tokens, args.top_k, args.llama_python, args.threads)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fidelity.json").write_text(json.dumps(report, indent=1))
        (args.out / "fidelity.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
