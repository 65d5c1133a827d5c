"""Text <-> token ids: the byte-level BPE stored in a GGUF's `tokenizer.ggml.*` metadata, or an HF directory's files.

From a GGUF, the vocabulary, merges and token types are rebuilt as a `tokenizers` BPE behind the pre-tokenizer
that `tokenizer.ggml.pre` names (llama.cpp's `qwen35` or `qwen2` split regex, then the byte-to-unicode map), with
control and user-defined tokens matched whole in the text, as llama.cpp's tokenizer does with special-token parsing
on. From an HF directory, transformers' own tokenizer is used. Either way decoding goes through each token's bytes,
and `StreamDecoder` holds back an incomplete UTF-8 sequence until the tokens that finish it arrive.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

from dflash_jax.chat_template import render
from dflash_jax.errors import InputError, brief
from dflash_jax.gguf import open_metadata

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp): contractions, letters (with combining marks for qwen35)
# after one optional non-letter, single digits, punctuation runs with trailing newlines, newline runs, whitespace.
PRE_TOKENIZERS = {
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# GGUF token types (llama.cpp's llama_token_type): matched whole in text rather than split by BPE
CONTROL, USER_DEFINED = 3, 4
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class TokenizerError(InputError):
    """A tokenizer that cannot be built from the given files."""


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable unicode character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _byte_level_bytes(piece: str) -> bytes:
    """The bytes a byte-level BPE token stands for (a token outside the alphabet is taken as its UTF-8 text)."""
    table = _byte_decoder()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.encode("utf-8")


class Tokenizer:
    """Encode text, decode ids, and the ids that end a reply; built by `from_gguf` or `from_hf_dir`."""

    def __init__(self, backend: Any, token_bytes: list[bytes], special: dict[str, int], eos_id: int | None,
                 chat_template: str | None, bos_token: str | None = None):
        self.backend = backend  # a tokenizers.Tokenizer
        self.token_bytes = token_bytes
        self.special = special  # text -> id of every token matched whole (control and user-defined)
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = token_bytes[eos_id].decode("utf-8", "replace") if eos_id is not None else None

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    @functools.cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a reply: the end-of-sequence token, `<|im_end|>` and `<|endoftext|>` where present."""
        ids = [self.eos_id] if self.eos_id is not None else []
        ids += [self.special[t] for t in STOP_TOKENS if t in self.special]
        return tuple(dict.fromkeys(ids))

    def encode(self, text: str) -> list[int]:
        """Token ids of text, special tokens (e.g. `<|im_start|>`) parsed; no BOS is added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def bytes_of(self, ids: Sequence[int], skip_stops: bool = False) -> bytes:
        """The bytes ids stand for (special tokens as their text), without the stop tokens if skip_stops."""
        skip = self.stop_ids if skip_stops else ()
        return b"".join(self.token_bytes[int(i)] for i in ids if int(i) not in skip)

    def decode(self, ids: Sequence[int], skip_stops: bool = False) -> str:
        """The text of ids (special tokens as their text; invalid UTF-8 replaced); skip_stops leaves out the
        tokens that end a reply."""
        return self.bytes_of(ids, skip_stops).decode("utf-8", errors="replace")

    def stream(self, skip_stops: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_stops)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None, tools: Sequence[dict] | None = None) -> str:
        """Prompt text of chat messages (and the tools offered) through this model's template (ChatML without one)."""
        return render(messages, self.chat_template, add_generation_prompt=add_generation_prompt,
                      enable_thinking=enable_thinking, bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer stored in a GGUF file's metadata (a `gpt2` byte-level BPE)."""
        meta = open_metadata(os.fspath(path))
        return cls.from_metadata(meta.value, os.fspath(path))

    @classmethod
    def from_metadata(cls, value: Callable[..., Any], where: str) -> "Tokenizer":
        """The tokenizer of GGUF `tokenizer.*` metadata, read by value(key[, default]) (a missing key without a
        default raises); `where` names the source in errors."""
        model = value("tokenizer.ggml.model", None)
        if model is None:
            raise TokenizerError(f"{where}: no tokenizer in the GGUF metadata (tokenizer.ggml.model is missing)")
        if model != "gpt2":
            raise TokenizerError(f"{where}: tokenizer.ggml.model {brief(model)} is not supported (only byte-level "
                                 f"BPE, 'gpt2')")
        pre = value("tokenizer.ggml.pre", "qwen2")
        if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"{where}: tokenizer.ggml.pre {brief(pre)} is not supported "
                                 f"({', '.join(PRE_TOKENIZERS)})")
        tokens = _list_of(value, "tokenizer.ggml.tokens", str, where)
        types = _list_of(value, "tokenizer.ggml.token_type", int, where, [1] * len(tokens))
        merges = _list_of(value, "tokenizer.ggml.merges", str, where, [])
        if len(types) != len(tokens):
            raise TokenizerError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} "
                                 f"tokens")
        eos = _token_id(value, "tokenizer.ggml.eos_token_id", len(tokens), where)
        bos = _token_id(value, "tokenizer.ggml.bos_token_id", len(tokens), where)
        template = value("tokenizer.chat_template", None)
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{where}: tokenizer.chat_template should be text, found {brief(template)}")
        special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)}
        backend = _bpe_backend(tokens, merges, PRE_TOKENIZERS[pre],
                               [(t, types[i] == CONTROL) for t, i in special.items()], where)
        token_bytes = [t.encode("utf-8") if t in special else _byte_level_bytes(t) for t in tokens]
        return cls(backend, token_bytes, special, eos, template,
                   None if bos is None else tokens[bos])

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer of an HF model directory (tokenizer.json and its config), through transformers."""
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
        except Exception as e:  # transformers raises assorted errors for a missing or broken tokenizer
            raise TokenizerError(f"{path}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerError(f"{path}: the tokenizer has no fast (tokenizers) backend")
        n = len(hf)
        added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        pieces = hf.convert_ids_to_tokens(list(range(n)))
        token_bytes = [p.encode("utf-8") if p in added else _byte_level_bytes(p or "") for p in pieces]
        eos = hf.eos_token_id
        return cls(backend, token_bytes, added, eos, getattr(hf, "chat_template", None), hf.bos_token)


def _list_of(value: Callable[..., Any], key: str, kind: type, where: str, default: Any = ...) -> list:
    """A metadata array whose entries are all of one kind (str or int; a bool is not an int here)."""
    v = value(key) if default is ... else value(key, default)
    if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
        raise TokenizerError(f"{where}: {key} should be an array of {kind.__name__}, found {brief(v)}")
    return v


def _token_id(value: Callable[..., Any], key: str, vocab: int, where: str) -> int | None:
    """An optional token id, inside the vocabulary."""
    v = value(key, None)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab):
        raise TokenizerError(f"{where}: {key} {brief(v)} is not a token id (the vocabulary has {vocab})")
    return v


def require_utf8(text: str, what: str) -> str:
    """text, after checking that it is valid UTF-8 (Python keeps undecodable bytes of argv and files as lone
    surrogates, which the tokenizer cannot encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
        raise TokenizerError(f"{what} is not valid UTF-8 ({byte} at character {e.start})") from None
    return text


def load_tokenizer(model_path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a model: a GGUF file's metadata, or an HF directory's tokenizer files."""
    if os.path.isdir(model_path):
        return Tokenizer.from_hf_dir(model_path)
    return Tokenizer.from_gguf(model_path)


def _bpe_backend(tokens: list[str], merges: list[str], pattern: str, added: list[tuple[str, bool]], where: str):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2 or p[0] not in vocab or p[1] not in vocab), None)
    if bad is not None:
        raise TokenizerError(f"{where}: tokenizer.ggml.merges entry {brief(bad)} is not two tokens of the vocabulary")
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=is_control, normalized=False) for t, is_control in added])
    return backend


class StreamDecoder:
    """Text of tokens as they arrive, never splitting a multi-byte UTF-8 character across two pieces."""

    def __init__(self, tokenizer: Tokenizer, skip_stops: bool = False):
        self.tokenizer, self.skip_stops, self.pending = tokenizer, skip_stops, b""

    def push(self, ids: Sequence[int]) -> str:
        """The text that ids complete (an unfinished character is kept for the next push)."""
        data = self.pending + self.tokenizer.bytes_of(ids, self.skip_stops)
        cut = _complete_prefix(data)
        self.pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is held back (an unfinished character at the end becomes U+FFFD)."""
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


def _complete_prefix(data: bytes) -> int:
    """Length of data without a trailing, still incomplete UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for its lead byte
            continue
        need = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
        return len(data) - back if back < need else len(data)
    return len(data)
