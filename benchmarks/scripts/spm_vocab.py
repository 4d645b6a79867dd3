"""A realistic SentencePiece vocabulary as a GGUF file, for measuring the SentencePiece
tokenizer (`benchmarks/scripts/spm_tokenize.py`): trains a BPE SentencePiece model with byte
fallback (as Llama 2's and Gemma's are) on text found on this machine (Python sources,
Markdown and text files), converts it as llama.cpp's converter does (pieces, scores, piece
types, BOS/EOS/UNK ids, add_space_prefix) and writes it into a GGUF file with a tiny llama
model's shapes, so that llama.cpp and transformers load it too. Also writes the mixed text
(code, prose, CJK, emoji) that the measurement tokenizes.

    PYTHONPATH=/tmp/sp:$PWD python benchmarks/scripts/spm_vocab.py OUT_DIR [VOCAB_SIZE]

Needs the `sentencepiece` package (not a specserve dependency: e.g.
`pip install --target /tmp/sp sentencepiece==0.2.0`).
"""
from __future__ import annotations

import random
import sys
import sysconfig
from pathlib import Path

import numpy as np

CJK = Path(sysconfig.get_paths()["stdlib"]) / "test" / "cjkencodings"
EMOJI = "😀🚀🎉👍🔥✨🤖📦🧪🌍"


def sources() -> list[Path]:
    """Text on this machine: the standard library and site-packages' Python and docs."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files = [p for r in roots for pat in ("*.py", "*.md", "*.txt", "*.rst") for p in r.rglob(pat)]
    return sorted(p for p in files if p.is_file() and 2_000 < p.stat().st_size < 400_000)


def read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def unicode_lines(rng: random.Random) -> list[str]:
    lines = [l for p in sorted(CJK.glob("*-utf8.txt")) for l in read(p).splitlines() if l.strip()]
    return [l + " " + "".join(rng.choice(EMOJI) for _ in range(3)) for l in lines]


def corpus(out: Path, max_bytes: int, rng: random.Random) -> Path:
    files = sources()
    rng.shuffle(files)
    path, size = out / "corpus.txt", 0
    with open(path, "w", encoding="utf-8") as f:
        for line in unicode_lines(rng) * 20:
            f.write(line + "\n")
        for p in files:
            text = read(p)
            f.write(text + "\n")
            size += len(text.encode())
            if size > max_bytes:
                break
    return path


def mixed_text(out: Path, rng: random.Random, size: int = 100_000) -> Path:
    """~`size` bytes: code, prose and Unicode lines interleaved in chunks."""
    code = [p for p in sources() if p.suffix == ".py"]
    prose = [p for p in sources() if p.suffix in (".md", ".rst", ".txt")]
    uni = unicode_lines(rng)
    parts, total = [], 0
    while total < size:
        kind = rng.choice(["code", "prose", "unicode"])
        if kind == "unicode":
            chunk = "\n".join(rng.sample(uni, 5)) + "\n"
        else:
            text = read(rng.choice(code if kind == "code" else prose))
            start = rng.randrange(max(1, len(text) - 3000))
            chunk = text[start:start + 3000]
        parts.append(chunk)
        total += len(chunk.encode())
    path = out / "mixed.txt"
    path.write_text("".join(parts), encoding="utf-8")
    return path


def train(corpus_path: Path, out: Path, vocab_size: int) -> Path:
    import sentencepiece as spm

    prefix = out / "spm"
    spm.SentencePieceTrainer.train(
        input=str(corpus_path), model_prefix=str(prefix), model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=0.9995,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", input_sentence_size=400_000,
        shuffle_input_sentence=True, max_sentence_length=8192, num_threads=2,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    return prefix.with_suffix(".model")


def write_gguf(model_path: Path, out: Path) -> Path:
    """The SentencePiece model's vocabulary in a GGUF file, as llama.cpp's converter writes it
    (piece, score, type per id; types use SentencePiece's numbering, which GGUF shares)."""
    import gguf
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    scores = [sp.get_score(i) for i in range(n)]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
             else 6 if sp.is_byte(i) else 4 if tokens[i] in ("<start_of_turn>", "<end_of_turn>")
             else 1 for i in range(n)]
    path = out / "spm32k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("context_length", 512), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("head_count", 4), ("head_count_kv", 4)]:
        getattr(w, f"add_{key}")(value)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((n, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = int(sys.argv[2]) if len(sys.argv) > 2 else 32000
    rng = random.Random(0)
    text = mixed_text(out, rng)
    model = train(corpus(out, 12_000_000, rng), out, vocab_size)
    print(write_gguf(model, out), text, model)


if __name__ == "__main__":
    main()
