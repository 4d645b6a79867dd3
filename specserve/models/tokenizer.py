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
conversation so that only the chat template's own control tokens are special: the template
is rendered with a random placeholder for each message's content, the template's text is
encoded with its special tokens and each content with none of them. A template that
transforms content (the placeholders do not come through whole, or the real content renders
otherwise, e.g. Gemma's `| trim`) is rendered with the real content instead; then a content
holding a special token's text is refused, since it could not be kept as text. A
SentencePiece tokenizer encodes the text between the template's special tokens (template text
and contents alike) as one run, as llama.cpp encodes the rendered prompt: the space prefix
comes once per run and pieces merge across a content's edges. The compiled template is kept
with the tokenizer.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from specserve.models import spm

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
BASE_ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


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
                    parse_special_in_content: bool = False, **extra) -> list[int]:
        """Token ids of a conversation under the chat template; the content of the messages
        is text (its special tokens' text stays text) unless `parse_special_in_content`."""
        if parse_special_in_content:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra))
        messages = check_messages(messages, self.chat_roles)
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if isinstance(m.get("content"), str)
                  else m for i, m in enumerate(messages)]
        rendered = self._render(marked, add_generation_prompt, extra)
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        texts = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
        if sorted(int(i) for i in parts[1::2]) != texts or "".join(
                messages[int(p)]["content"] if k % 2 else p for k, p in enumerate(parts)
        ) != self._render(messages, add_generation_prompt, extra):  # the template changed it
            return self._chat_as_one_text(messages, add_generation_prompt, extra)
        if self.pieces is not None:
            return self._with_specials(self._runs(parts, messages))
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                ids += self._pieces(messages[int(part)]["content"], parse_special=False)
            elif part:
                ids += self._pieces(part, parse_special=True)
        return self._with_specials(ids)

    def _runs(self, parts: list[str], messages: list[dict]) -> list[int]:
        """The ids of a rendered conversation (`parts`: template text, then a content's index,
        alternately) where only the template's special tokens are special; the text between
        them encoded whole, as text."""
        specials = sorted((t.content for t in self.backend.get_added_tokens_decoder().values()
                           if t.special), key=len, reverse=True)
        split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        ids: list[int] = []
        run: list[str] = []
        for k, part in enumerate(parts):
            pieces = [messages[int(part)]["content"]] if k % 2 else \
                split.split(part) if split else [part]
            for j, piece in enumerate(pieces):
                if k % 2 or j % 2 == 0:
                    run.append(piece)
                    continue
                if "".join(run):
                    ids += self._pieces("".join(run), parse_special=False)
                ids.append(self.backend.token_to_id(piece))
                run = []
        if "".join(run):
            ids += self._pieces("".join(run), parse_special=False)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.pieces is not None:
            return self.pieces.decode(ids, skip_special_tokens)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        messages = check_messages(messages, self.chat_roles)
        return self._render(messages, add_generation_prompt, extra)

    @functools.cached_property
    def _template(self) -> jinja2.Template:
        return _jinja_env().from_string(self.chat_template)

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

    def _render(self, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: the model's chat template refused them: {e}") from None

    def _chat_as_one_text(self, messages: list[dict], add_generation_prompt: bool,
                          extra: dict) -> list[int]:
        specials = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        for i, m in enumerate(messages):
            content = m.get("content") or ""
            found = next((t for t in specials if t and t in content), None)
            if found is not None:
                raise ValueError(f"messages[{i}].content holds the special token {found!r}, which "
                                 f"this model's chat template cannot keep as text")
        return self.encode(self._render(messages, add_generation_prompt, extra))

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


def check_text(field: str, text: object) -> str:
    """Return `text` if it is a string of valid Unicode; a lone surrogate is a ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{field} contains a lone surrogate {text[e.start]!r} at index "
                             f"{e.start}; text must be valid Unicode") from None
    return text


def check_messages(messages: object, roles: tuple[str, ...]) -> list[dict]:
    """Validate one conversation; return it with content-part lists joined into strings.

    Each message is a dict with a `role` from `roles` and a `content` that is a string or a
    list of `{"type": "text", "text": ...}` parts; an assistant message that carries
    `tool_calls` may have null content.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    return [_check_message(i, m, roles) for i, m in enumerate(messages)]


def _check_message(i: int, message: object, roles: tuple[str, ...]) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {message!r}")
    unknown = [k for k in message if k not in MESSAGE_KEYS]
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; known: {list(MESSAGE_KEYS)}")
    if "role" not in message:
        raise ValueError(f"{where}.role is missing (one of {', '.join(roles)})")
    role = message["role"]
    if not isinstance(role, str) or role not in roles:
        raise ValueError(f"{where}.role must be one of {', '.join(roles)} for this model's "
                         f"chat template, got {role!r}")
    checked = dict(message)
    content = message.get("content")
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise ValueError(f"{where}.content is missing (a string or a list of text parts)")
    if content is not None:
        checked["content"] = _content_text(f"{where}.content", content)
    if "name" in message:
        check_text(f"{where}.name", message["name"])
    return checked


def _content_text(where: str, content: object) -> str:
    if isinstance(content, str):
        return check_text(where, content)
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where} must be a string or a non-empty list of text parts "
                         f"({{'type': 'text', 'text': ...}}), got {content!r}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"}:
            raise ValueError(f"{where}[{j}] must be {{'type': 'text', 'text': ...}} (only text "
                             f"parts are supported), got {part!r}")
        texts.append(check_text(f"{where}[{j}].text", part["text"]))
    return "\n".join(texts)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


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
