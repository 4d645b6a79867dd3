"""Tokenizer and chat template, built from a model's own files.

GGUF files carry a byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2": `.tokens`,
`.merges`, `.token_type` and the pre-tokenizer's name `.pre`) or a SentencePiece one ("llama":
`.tokens`, `.scores`, `.token_type`, see `spm.py`), and a Jinja chat template; Hugging Face
directories carry `tokenizer.json` and `tokenizer_config.json`.

Text must be valid Unicode: a lone surrogate (e.g. from `"\\ud800"` or a bad JSON escape) is
a `ValueError` naming where it is. Chat messages are checked before the template sees them
(`check_messages`): a role the template knows, content that is a string or OpenAI's list of
text parts (joined with newlines), no unknown keys; an error the template itself raises
(e.g. "roles must alternate") comes back as a `ValueError` too.

Special tokens written as text: `encode(text, parse_special=False)` keeps `<|im_start|>` in
`text` as the characters it is, never the control token. `encode_chat` encodes a
conversation (and its tools) so that only the chat template's own control tokens are
special: the template is rendered with placeholders for the client's strings
(`chat_template.ClientText`), the template's text is encoded with its special tokens and the
client's with none of them. A template that transforms client text (so the placeholders do
not come through whole, e.g. Gemma's `| trim`) is rendered with the real text instead; then a
client string holding a special token's text is refused, since it could not be kept as text.
A SentencePiece tokenizer encodes the text between the template's special tokens (template
text and client text alike) as one run, as llama.cpp encodes the rendered prompt. The
compiled template is kept with the tokenizer.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from dataclasses import dataclass

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from specserve.models import spm
from specserve.models.chat_template import (BASE_ROLES, ClientText, check_messages, check_text,
                                            check_tools, jinja_env, strings)

__all__ = ["Tokenizer", "check_text", "check_messages", "from_gguf_metadata", "from_hf_dir"]

# Split patterns of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT,
           "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4


@dataclass(frozen=True)
class Tokenizer:
    backend: HFTokenizer
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    add_bos: bool
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token / eos_token / ... as text, for templates
    add_eos_id: int | None = None  # appended to every encoding (llama.cpp's add_eos)
    pieces: spm.PieceDecoder | None = None  # decodes in place of the backend (SentencePiece)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_roles(self) -> tuple[str, ...]:
        """The roles a chat message may take: system, user, assistant, and tool when the
        template mentions a 'tool' role."""
        template = self.chat_template or ""
        knows_tool = "'tool'" in template or '"tool"' in template
        return BASE_ROLES + (("tool",) if knows_tool else ())

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (a BOS first where the model adds one). `parse_special`: the
        text of a special token becomes that token; False: it stays text."""
        check_text("text", text)
        ids = self._pieces(text, parse_special)
        return self._with_specials(ids)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    parse_special_in_content: bool = False, tools: list[dict] | None = None,
                    **extra) -> list[int]:
        """Token ids of a conversation (and its tools) under the chat template; every client
        string is text (its special tokens' text stays text; `chat_template.ClientText`)
        unless `parse_special_in_content`."""
        if parse_special_in_content:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                        tools=tools, **extra))
        messages, tools = check_messages(messages, self.chat_roles), check_tools(tools)
        guard = ClientText(self.special_texts)
        marked, marked_tools = guard.mark(messages, tools)
        pieces = guard.split(self._render(marked, add_generation_prompt, marked_tools, extra),
                             messages)
        if pieces is None or "".join(text for text, _ in pieces) != self._render(
                messages, add_generation_prompt, tools, extra):  # the template changed client
            # text on its way through (e.g. trimmed it, which a placeholder does not show)
            return self._chat_as_one_text(messages, add_generation_prompt, tools, extra)
        return self._with_specials(self._encode_pieces(pieces))

    def _encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Template text with its special tokens, client text as text. The whole text is
        encoded at once (as the model saw its training chats) unless a special token of that
        encoding touches client text; then each piece is encoded on its own (SentencePiece:
        each run between the template's special tokens)."""
        whole = "".join(text for text, _ in pieces)
        encoding = self.backend.encode(whole, add_special_tokens=False)
        client, at = [], 0
        for text, is_client in pieces:
            if is_client and text:
                client.append((at, at + len(text)))
            at += len(text)
        starts = [a for a, _ in client]
        for token, (a, b) in zip(encoding.ids, encoding.offsets):
            k = bisect.bisect_right(starts, b - 1) - 1  # the last client span starting before b
            if token in self._special_ids and k >= 0 and client[k][1] > a:
                break
        else:
            return encoding.ids
        if self.pieces is not None:
            return self._runs(pieces)
        return [t for text, is_client in pieces if text
                for t in self._pieces(text, parse_special=not is_client)]

    def _runs(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """The ids of rendered pieces where only the template's special tokens are special and
        the text between them (template and client text alike) is encoded whole, as text."""
        specials = sorted(self.special_texts, key=len, reverse=True)
        split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        ids: list[int] = []
        run: list[str] = []
        for text, is_client in pieces:
            parts = [text] if is_client or split is None else split.split(text)
            for j, part in enumerate(parts):
                if is_client or j % 2 == 0:
                    run.append(part)
                    continue
                if "".join(run):
                    ids += self._pieces("".join(run), parse_special=False)
                ids.append(self.backend.token_to_id(part))
                run = []
        if "".join(run):
            ids += self._pieces("".join(run), parse_special=False)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.pieces is not None:
            return self.pieces.decode(ids, skip_special_tokens)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **extra) -> str:
        """The conversation as the chat template writes it (special tokens as their text)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        messages = check_messages(messages, self.chat_roles)
        return self._render(messages, add_generation_prompt, check_tools(tools), extra)

    @functools.cached_property
    def special_texts(self) -> list[str]:
        """The text of every special (control) token."""
        return [t.content for t in self.backend.get_added_tokens_decoder().values()
                if t.special and t.content]

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _template(self) -> jinja2.Template:
        return jinja_env().from_string(self.chat_template)

    def prepare(self) -> None:
        """Build what the first text-only encode would (a copy of the backend: 0.3 s for
        Qwen2.5's vocabulary), so that it is not on a request's clock."""
        self._text_backend

    @functools.cached_property
    def _text_backend(self) -> HFTokenizer:
        """A copy of the backend that reads special tokens' text as text."""
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list | None,
                extra: dict) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        if tools is not None:
            extra = {**extra, "tools": tools}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: the model's chat template refused them: {e}") from None

    def _chat_as_one_text(self, messages: list[dict], add_generation_prompt: bool,
                          tools: list | None, extra: dict) -> list[int]:
        fields = [(f"messages[{i}].{k}", v) for i, m in enumerate(messages) for k, v in m.items()]
        for where, value in [*fields, ("tools", tools)]:
            found = next((t for s in strings(value) for t in self.special_texts if t in s), None)
            if found is not None:
                raise ValueError(f"{where} holds the special token {found!r}, which this "
                                 f"model's chat template cannot keep as text")
        return self.encode(self._render(messages, add_generation_prompt, tools, extra))

    def _pieces(self, text: str, parse_special: bool) -> list[int]:
        backend = self.backend if parse_special else self._text_backend
        return backend.encode(text, add_special_tokens=False).ids

    def _with_specials(self, ids: list[int]) -> list[int]:
        """A BOS first where the model adds one (unless the text began with it), an EOS last
        where it adds one."""
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        if self.add_eos_id is not None:
            ids = ids + [self.add_eos_id]
        return ids


def _byte_alphabet() -> set[str]:
    return set(pre_tokenizers.ByteLevel.alphabet())


def from_gguf_metadata(meta: dict) -> Tokenizer:
    """Build the tokenizer from GGUF `tokenizer.*` metadata (`gguf_loader.read_metadata`'s
    values); a backend built before from the same vocabulary bytes is reused (`_BACKENDS`)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        v = spm.from_gguf(meta)
        return Tokenizer(v.backend, v.eos_token_ids, v.bos_token_id, v.add_bos,
                         meta.get("tokenizer.chat_template"), v.special_tokens, v.add_eos_id,
                         v.decoder)
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE "
                         f"'gpt2' and SentencePiece 'llama' are)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    key = _backend_key(meta, types)
    backend = _BACKENDS.get(key) if key is not None else None
    if backend is None:
        backend = _bpe_backend(meta, tokens, types)
        if key is not None:
            _BACKENDS[key] = backend
            while len(_BACKENDS) > MAX_BACKENDS:
                del _BACKENDS[next(iter(_BACKENDS))]

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None else None

    specials = {name: backend.id_to_token(i) for name, key in
                [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                 ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")]
                if (i := token_id(key)) is not None}
    eos = {i for i in [token_id("eos_token_id"), token_id("eot_token_id")] if i is not None}
    return Tokenizer(backend, frozenset(eos), token_id("bos_token_id"),
                     bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     meta.get("tokenizer.chat_template"), specials)


# Backends built from GGUF metadata, by what they are built from: the two models of a pair
# carry the same vocabulary, so the second load reuses the first's (its build is most of a
# warm load: ~0.4 s for 152k tokens, after reading them ~0.2 s). Read-only once built.
MAX_BACKENDS = 4
_BACKENDS: dict[tuple, HFTokenizer] = {}


def _backend_key(meta: dict, types: list[int]) -> tuple | None:
    """What a backend is built from, the long string arrays named by the digest of their bytes
    in the file (`gguf_file.StringArray.digest`); None where they came as plain lists
    (nothing to save: they were read anyway)."""
    tokens, merges = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.merges", [])
    digest = getattr(tokens, "digest", None)
    if digest is None:
        return None
    merged = getattr(merges, "digest", None) or tuple(merges)
    return digest, merged, tuple(types), meta.get("tokenizer.ggml.pre", "")


def _merge_pairs(merges) -> list[tuple[str, str]]:
    """GGUF merges ("a b", split at the first space) as pairs: where every merge holds exactly
    one space and no newline, as byte-level BPE merges do, by one join and one split."""
    merges = list(merges)
    joined = "\n".join(merges)
    if joined.count(" ") == len(merges) and joined.count("\n") == len(merges) - 1 \
            and _TWO_SPACES.search(joined) is None:
        parts = joined.replace("\n", " ").split(" ")
        return list(zip(parts[::2], parts[1::2]))
    return [tuple(m.split(" ", 1)) for m in merges]


_TWO_SPACES = re.compile(r" [^\n]* ")  # a line with two spaces


def _bpe_backend(meta: dict, tokens, types: list[int]) -> HFTokenizer:
    """The byte-level BPE of GGUF `tokenizer.*` metadata, its control and user tokens added."""
    merges = _merge_pairs(meta.get("tokenizer.ggml.merges", []))
    tokens = list(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    alphabet = _byte_alphabet()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types)
                                if ty == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return backend


def from_hf_dir(path, eos_from_config: list[int]) -> Tokenizer:
    """Build the tokenizer from `tokenizer.json` + `tokenizer_config.json` in `path`."""
    file = path / "tokenizer.json"
    if not file.exists():
        raise ValueError(f"{path}: no tokenizer.json")
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{file}: cannot load the tokenizer ({e})") from None
    cfg_file = path / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    except ValueError as e:
        raise ValueError(f"{cfg_file}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: must hold a JSON object")

    def text_of(entry) -> str | None:
        return entry.get("content") if isinstance(entry, dict) else entry

    specials = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if (v := text_of(cfg.get(k))) is not None}
    eos = set(eos_from_config)
    if "eos_token" in specials and (i := backend.token_to_id(specials["eos_token"])) is not None:
        eos.add(i)
    bos = backend.token_to_id(specials["bos_token"]) if "bos_token" in specials else None
    template = cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if backend.decoder is None:
        backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, frozenset(eos), bos, bool(cfg.get("add_bos_token", False)),
                     template, specials)


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
