"""The SentencePiece tokenizer on a GGUF vocabulary against its references: ids of a text
(whole, and line by line) identical to transformers' GGUF conversion, to SentencePiece itself
(its `.model`, where given) and to llama.cpp (a tool built from its sources, where given),
the decode round trip, and the time per MB of each (best of `--repeat`), the text as one
piece and line by line.

    python benchmarks/scripts/spm_tokenize.py VOCAB.gguf TEXT [--spm SPM.model]
        [--llama-cpp SPMTOK] [--repeat 5]

VOCAB.gguf and TEXT come from `spm_vocab.py`. SPMTOK is a program on llama.cpp's library
(`spmtok MODEL tokenize PARSE_SPECIAL REPEAT` reads NUL-separated texts and prints one line
of ids per text, and the best time of REPEAT runs on stderr).

transformers' GGUF tokenizer puts `▁` in front only where the text does not already start
with one, llama.cpp and SentencePiece always do (`"  x"` → `▁▁▁x`), so its ids are those of
`" " + text`.
"""
from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from specserve.models.tokenizer import from_gguf_metadata
from specserve.weights.gguf_loader import open_gguf, read_metadata


def best_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def llama_cpp(tool: str, gguf: Path, texts: list[str], repeat: int
              ) -> tuple[list[list[int]], float]:
    out = subprocess.run([tool, str(gguf), "tokenize", "0", str(repeat)],
                         input="\0".join(texts).encode(), capture_output=True, check=True)
    lines = out.stdout.decode().split("\n")[:len(texts)]
    return [[int(x) for x in line.split()] for line in lines], float(out.stderr.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("text", type=Path)
    ap.add_argument("--spm", default=None)
    ap.add_argument("--llama-cpp", default=None)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    text = a.text.read_text(encoding="utf-8")
    lines = [line for line in text.split("\n") if line]
    mb = len(text.encode()) / 1e6
    start = time.perf_counter()
    tok = from_gguf_metadata(read_metadata(open_gguf(a.gguf)))
    print(f"vocabulary {tok.vocab_size} tokens, built in {time.perf_counter() - start:.2f} s; "
          f"text {mb * 1e3:.0f} KB, {len(lines)} lines")
    ours = tok._pieces(text, parse_special=False)
    ours_lines = [tok._pieces(line, parse_special=False) for line in lines]
    tok.prepare()
    t = best_time(lambda: tok._pieces(text, parse_special=False), a.repeat)
    tl = best_time(lambda: [tok._pieces(line, parse_special=False) for line in lines], a.repeat)
    print(f"specserve    {len(ours)} ids, {t / mb * 1e3:.0f} ms/MB whole, "
          f"{tl / mb * 1e3:.0f} ms/MB by line")
    print(f"round trip   {'identical' if tok.decode(ours) == text else 'DIFFERS'}")

    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(a.gguf.parent), gguf_file=a.gguf.name)
    theirs = ref.encode(" " + text, add_special_tokens=False)
    theirs_lines = [ref.encode(" " + line, add_special_tokens=False) for line in lines]
    t = best_time(lambda: ref.encode(" " + text, add_special_tokens=False), a.repeat)
    tl = best_time(lambda: [ref.encode(" " + x, add_special_tokens=False) for x in lines],
                   a.repeat)
    print(f"transformers {len(theirs)} ids, {t / mb * 1e3:.0f} ms/MB whole, "
          f"{tl / mb * 1e3:.0f} ms/MB by line; whole text "
          f"{'identical' if theirs == ours else 'DIFFERS'}, lines identical "
          f"{sum(x == y for x, y in zip(ours_lines, theirs_lines))}/{len(lines)}")
    if a.spm:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=a.spm)
        theirs, theirs_lines = sp.encode(text), [sp.encode(line) for line in lines]
        t = best_time(lambda: sp.encode(text), a.repeat)
        tl = best_time(lambda: [sp.encode(line) for line in lines], a.repeat)
        print(f"sentencepiece {len(theirs)} ids, {t / mb * 1e3:.0f} ms/MB whole, "
              f"{tl / mb * 1e3:.0f} ms/MB by line; whole text "
              f"{'identical' if theirs == ours else 'DIFFERS'}, lines identical "
              f"{sum(x == y for x, y in zip(ours_lines, theirs_lines))}/{len(lines)}")
    if a.llama_cpp:
        (theirs,), t = llama_cpp(a.llama_cpp, a.gguf, [text], a.repeat)
        theirs_lines, tl = llama_cpp(a.llama_cpp, a.gguf, lines, a.repeat)
        print(f"llama.cpp    {len(theirs)} ids, {t / mb * 1e3:.0f} ms/MB whole, "
              f"{tl / mb * 1e3:.0f} ms/MB by line; whole text "
              f"{'identical' if theirs == ours else 'DIFFERS'}, lines identical "
              f"{sum(x == y for x, y in zip(ours_lines, theirs_lines))}/{len(lines)}")


if __name__ == "__main__":
    main()
