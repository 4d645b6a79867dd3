"""The `specserve` command: download, generate, demo, bench, serve.

Errors: whatever subcommand runs, a failure the user can cause or fix (a bad value, a
missing file, an unusable or corrupt model cache, a malformed model) prints one line,
`specserve <cmd>: error: ...`, and exits 2 for bad input (`ValueError`) or 1 for the
environment (`OSError`, `DownloadError`); Ctrl-C exits 130 quietly. `--debug` (or
SPECSERVE_DEBUG=1) lets the exception through with its traceback. Any other exception is a
bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (OpenAI/vLLM names)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET, help="alias, GGUF file or HF directory "
                   f"(default {DEFAULT_TARGET}; aliases: {', '.join(m.alias for m in MODELS)})")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: float32 on the native quantized kernels, else bfloat16")
    p.add_argument("--weights", default="auto", choices=["auto", "bf16", "float32", "int8", "int4"],
                   help="auto (default): a quantized GGUF file stays quantized on the native "
                        "kernels (int4, its >4-bit tensors at 8 bits; float32 activations), a "
                        "float checkpoint loads bf16; int8/int4 quantize any checkpoint")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="KV cache dtype (auto: float16 on the native kernels, else the "
                        "activations' dtype)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "draft_model", "model": "qwen2.5-coder-0.5b", '
                        '"num_speculative_tokens": 4}\'')
    g.add_argument("--draft-model", default=None, help="shorthand for method draft_model")
    g.add_argument("--ngram", action="store_true", help="shorthand for method ngram (prompt lookup)")
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="k; -1 lets the cost-aware policy choose")
    g.add_argument("--tv-budget", type=float, default=None, help="mentored decoding budget D in [0, 1]")
    g.add_argument("--draft-policy", default=None)
    g.add_argument("--no-bonus-token", action="store_true")


def speculative_config(args) -> dict | None:
    config = _json_object("--speculative-config", args.speculative_config) \
        if args.speculative_config else None
    if args.draft_model or args.ngram:
        config = dict(config or {}, method="ngram" if args.ngram else "draft_model")
        if args.draft_model:
            config["model"] = args.draft_model
    if config is None:
        return None
    overrides = {"num_speculative_tokens": args.num_speculative_tokens, "tv_budget": args.tv_budget,
                 "draft_policy": args.draft_policy, "bonus_token": False if args.no_bonus_token else None}
    config.update({k: v for k, v in overrides.items() if v is not None})
    return config


def sampling_params(args):
    from specserve.sampling.params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos)


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def read_text_file(flag: str, path: str) -> str:
    """The UTF-8 text of a file named on the command line; ValueError naming the flag."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


def read_prompt(args) -> str:
    if args.prompt_file:
        return read_text_file("--prompt-file", args.prompt_file)
    if args.prompt is None or args.prompt == "-":
        if sys.stdin.isatty() and args.prompt is None:
            raise ValueError("give --prompt TEXT, --prompt-file FILE, or pipe the prompt on stdin")
        try:
            return sys.stdin.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"stdin: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return args.prompt


def cmd_download(args) -> int:
    from specserve.hub.registry import download

    for path in download(args.names or None, verify=args.verify):
        print(path)
    return 0


def cmd_generate(args) -> int:
    from specserve.llm import LLM

    params = sampling_params(args)
    prompt = read_prompt(args)
    llm = LLM(args.model, dtype=args.dtype, speculative_config=speculative_config(args),
              max_model_len=args.max_model_len, weights=args.weights,
              kv_cache_dtype=args.kv_cache_dtype)
    print(f"# loaded {llm.target.path.name} in {llm.target.load_seconds:.1f}s", file=sys.stderr)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": prompt}], params)
    else:
        outputs = llm.generate(prompt, params)
    for out in outputs[0].outputs:
        if args.json:
            print(json.dumps(_output_dict(out)))
            continue
        print(out.text)
        print(_stats_line(out), file=sys.stderr)
    return 0


def _output_dict(out) -> dict:
    return {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            "num_output_tokens": out.num_output_tokens, "ttft_s": out.ttft,
            "decode_tokens_per_s": out.decode_tokens_per_s,
            "speculative": out.spec.as_dict() if out.spec else None}


def _stats_line(out) -> str:
    tps = out.decode_tokens_per_s
    line = (f"# {out.num_output_tokens} tokens, finish {out.finish_reason}, TTFT {out.ttft:.2f}s, "
            f"decode {'-' if tps is None else f'{tps:.2f}'} tokens/s")
    return line + (f"\n# speculative: {out.spec.summary()}" if out.spec else "")


def cmd_demo(args) -> int:
    """The cost-aware default vs target-only on a code edit and an open question (`demo.py`)."""
    from specserve import demo

    prompts = (("your prompt", read_text_file("--prompt-file", args.prompt_file)),) \
        if args.prompt_file else demo.WORKLOADS
    results = demo.run(args.model, args.draft_model, args.dtype, args.weights, args.max_tokens,
                       args.num_speculative_tokens, prompts)
    for r in results:
        print("\n".join(r.lines()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("download", help="fetch and verify the default models into the cache")
    p.add_argument("names", nargs="*", help="aliases (default: all)")
    p.add_argument("--verify", action="store_true",
                   help="re-hash every cached file (sha256) instead of trusting its stamp")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("generate", help="generate text for one prompt")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--prompt", default=None, help="prompt text ('-' or omitted: read stdin)")
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print outputs as JSON lines")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the cost-aware default vs target-only on the default pair: "
                       "a code edit and an open question")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--draft-model", default=DEFAULT_DRAFT)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--weights", default="auto", choices=["auto", "bf16", "float32", "int8", "int4"],
                   help="auto (default): the default pair stays quantized (int4-style), the "
                        "fast path, ~3x bf16's decode speed here")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=-1,
                   help="-1 (default): the cost-aware policy chooses k each round")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--prompt-file", default=None)
    p.set_defaults(func=cmd_demo)

    from specserve.bench.cli import add_parser as add_bench

    add_bench(sub)
    from specserve.server.cli import add_parser as add_serve

    add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specserve.hub.registry import DownloadError

    args = argparse.Namespace(command=None, debug=False)
    try:
        args = _parse(argv)
        return args.func(args)
    except KeyboardInterrupt:
        if _debug(args):
            raise
        return 130
    except BrokenPipeError:  # e.g. `specserve generate ... | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError, DownloadError, MemoryError) as e:
        if _debug(args):
            raise
        name = f"specserve {args.command}" if args.command else "specserve"
        print(f"{name}: error: {_one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse with `--debug` accepted before or after the subcommand."""
    parser = build_parser()
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            if "--debug" not in sub._option_string_actions:
                sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="show tracebacks of errors")
    return parser.parse_args(argv)


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False) or os.environ.get("SPECSERVE_DEBUG"))


def _one_line(e: BaseException) -> str:
    """The error's message on one line; an OSError as `file: reason`."""
    if isinstance(e, OSError) and e.strerror:
        text = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    elif isinstance(e, MemoryError):
        text = f"out of memory {e}".strip()
    else:
        text = str(e) or type(e).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
