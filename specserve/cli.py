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

from specserve.config import LLMConfig, add_llm_flags
from specserve.flags import add_flag, add_flags, build
from specserve.hub.registry import DEFAULT_DRAFT
from specserve.sampling.params import SamplingParams
from specserve.speculative.config import SpeculativeConfig
from specserve.weights.config import LoadConfig

# `generate` greedy by default, with room for an answer; the per-request mentored budget is
# the engine's `--tv-budget` here, and there is no output for logprobs
GENERATE_SAMPLING = {"temperature": 0.0, "max_tokens": 256}
SAMPLING_EXCLUDED = ("logprobs", "tv_budget")


def sampling_params(args: argparse.Namespace):
    """The `SamplingParams` of the sampling flags (errors keep the API's field names)."""
    from specserve.sampling.params import SamplingParams

    return build(SamplingParams, args, exclude=SAMPLING_EXCLUDED, rename=False)


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
    from specserve.hub.resolver import download

    for path in download(args.names or None, verify=args.verify):
        print(path)
    return 0


def cmd_generate(args) -> int:
    from specserve.llm import LLM

    params = sampling_params(args)
    config = LLMConfig.from_args(args)
    prompt = read_prompt(args)
    llm = LLM.from_config(config)
    carried = f"; {llm.target.carried}" if llm.target.carried else ""
    print(f"# loaded {llm.target.path.name} in {llm.target.load_seconds:.1f}s "
          f"({llm.target.weights} weights{carried})", file=sys.stderr)
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


def generate_speculation(args: argparse.Namespace) -> dict:
    """generate's speculation when no flag names a method: serve's default (one log line)."""
    from specserve import default_speculation

    return default_speculation.of_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("download", help="fetch and verify models into the cache: the default "
                       "models, or Hugging Face Hub models by id")
    p.add_argument("names", nargs="*", help="aliases or Hub ids org/repo[:QUANT] (default: "
                   "every alias)")
    p.add_argument("--verify", action="store_true",
                   help="re-hash every cached file (sha256) instead of trusting its stamp")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("generate", help="generate text for one prompt")
    add_llm_flags(p, generate_speculation, title="speculative decoding (default: as serve's: "
                  "hybrid with the default draft for a target of its vocabulary, else suffix "
                  "drafting)")
    add_flags(p.add_argument_group("sampling (OpenAI/vLLM names)"), SamplingParams,
              defaults=GENERATE_SAMPLING, exclude=SAMPLING_EXCLUDED)
    p.add_argument("--prompt", default=None, help="prompt text ('-' or omitted: read stdin)")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print outputs as JSON lines")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the cost-aware default vs target-only on the default pair: "
                       "a code edit and an open question")
    add_flags(p, LoadConfig)
    add_flag(p, SpeculativeConfig, "model", default=DEFAULT_DRAFT)
    add_flag(p, SpeculativeConfig, "num_speculative_tokens", default=-1)
    add_flag(p, SamplingParams, "max_tokens", default=160)
    p.add_argument("--prompt-file", default=None,
                   help="time this prompt (a UTF-8 file) instead of the two shipped ones")
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
