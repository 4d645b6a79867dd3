"""Tiny SentencePiece vocabularies as llama.cpp's converter writes them into GGUF files
(`tokenizer.ggml.model` "llama"), and tiny models that carry them.

A vocabulary is learned by BPE on a small corpus, as SentencePiece's BPE trainer does: each
merge a piece, scored minus its rank; the corpus's characters after them (scored lower);
`<unk>`, `<s>`, `</s>`, 256 byte-fallback tokens, control, user-defined and unused tokens
besides. "llama" is Llama 2's layout (a space prefix, BOS 1); "gemma" is Gemma's (no space
prefix, `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, runs of spaces as user-defined tokens).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

from specserve.models.spm import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

SPACE = "\u2581"
CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.
def tokenize(text):
    return [piece for piece in text.split() if piece]
for i in range(10): print(i, i * 2, "value")
Tokenizers split text into pieces, and pieces into ids. Byte fallback covers the rest.
The rain in Spain stays mainly in the plain. 12345 67890 3.14159 -42 +7 = 49%
中文 分词 测试 中文分词 emoji 😀 🚀 café naïve résumé
if (x > 0) { return x; } else { return -x; } // comment
"""
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') }}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
LLAMA2_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + m['content'] | trim + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_space_prefix: bool
    bos: int
    eos: int
    unk: int
    pad: int | None
    template: str


def learn_pieces(corpus: str, num_merges: int) -> tuple[list[str], list[str]]:
    """(merged pieces in the order learned, the corpus's characters): BPE over words with `▁`
    in front, as SentencePiece sees text."""
    words = collections.Counter(SPACE + w for w in corpus.split())
    split = {w: list(w) for w in words}
    pieces: list[str] = []
    for _ in range(num_merges):
        pairs: collections.Counter = collections.Counter()
        for w, n in words.items():
            for a, b in zip(split[w], split[w][1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for w in words:
            s, out, i = split[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            split[w] = out
    chars = sorted({c for w in words for c in w})
    return pieces, chars


def vocab(kind: str = "llama", num_merges: int = 300) -> Vocab:
    """A vocabulary in the layout of `kind` ("llama" or "gemma")."""
    pieces, chars = learn_pieces(CORPUS, num_merges)
    gemma = kind == "gemma"
    head = ([("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN)]
            if gemma else [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)])
    head += [(f"<0x{b:02X}>", BYTE) for b in range(256)]
    head += [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("<think>", USER_DEFINED),
             ("<unused0>", UNUSED)]
    if gemma:
        head += [("\t\t", USER_DEFINED), ("  ", USER_DEFINED), ("   ", USER_DEFINED)]
    body = [p for p in pieces if p not in chars] + [c for c in chars if c not in pieces]
    tokens = [t for t, _ in head] + body
    types = [ty for _, ty in head] + [NORMAL] * len(body)
    scores = [0.0] * len(head) + [-float(i) for i in range(len(body))]
    if gemma:
        return Vocab(tokens, scores, types, False, 2, 1, 3, 0, GEMMA_TEMPLATE)
    return Vocab(tokens, scores, types, True, 1, 2, 0, None, LLAMA2_TEMPLATE)


def add_to_gguf(writer, v: Vocab) -> None:
    """Write `v` as llama.cpp's converter does."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(v.tokens)
    writer.add_token_scores(v.scores)
    writer.add_token_types(v.types)
    writer.add_bos_token_id(v.bos)
    writer.add_eos_token_id(v.eos)
    writer.add_unk_token_id(v.unk)
    if v.pad is not None:
        writer.add_pad_token_id(v.pad)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(v.add_space_prefix)
    writer.add_chat_template(v.template)


def write_model(path: Path, kind: str = "llama", qtype: str = "F32") -> Path:
    """A tiny model (llama architecture for "llama", gemma3 for "gemma") carrying the
    vocabulary of `kind`, as a GGUF file at `path` with its matrices in `qtype`."""
    from gguf import GGMLQuantizationType

    from tests import tiny

    v = vocab(kind)
    arch = "gemma3" if kind == "gemma" else "llama"
    model = tiny.build_hf_model(arch, vocab=len(v.tokens))
    types = {"default": GGMLQuantizationType[qtype]}
    tiny.write_gguf_pair(model, arch, types, path, path.with_suffix(".hf"),
                         vocab_writer=lambda writer: add_to_gguf(writer, v))
    return path
