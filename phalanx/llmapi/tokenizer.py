"""Tokenizer loading (Hugging Face directory or GGUF metadata) and incremental detokenization.

Text work happens only in the user process; ranks see token ids.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any

# Hugging Face's GGUF path rebuilds the vocabulary on every load (seconds); the result is kept
# in memory and on disk (PHALANX_CACHE_DIR, default ~/.cache/phalanx), keyed by file identity.
_GGUF_CACHE: dict[str, Any] = {}


def cache_dir() -> str:
    base = os.environ.get("PHALANX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "phalanx")
    return base


def _gguf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer
    if path in _GGUF_CACHE:
        return _GGUF_CACHE[path]
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    saved = os.path.join(cache_dir(), "tokenizers", key)
    hf = None
    if os.path.exists(os.path.join(saved, "tokenizer.json")):
        try:
            hf = AutoTokenizer.from_pretrained(saved)
        except Exception:
            hf = None
    if hf is None:
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        try:
            tmp = f"{saved}.tmp{os.getpid()}"
            hf.save_pretrained(tmp)
            os.makedirs(os.path.dirname(saved), exist_ok=True)
            os.replace(tmp, saved)
        except OSError:
            pass  # a read-only home: no disk cache
    _GGUF_CACHE[path] = hf
    return hf


def _one_template(template: Any) -> str | None:
    """A tokenizer's chat template as one string: of named templates (transformers holds a dict
    where a tokenizer ships several, e.g. "default" and "tool_use"), the default one (else the
    first). Tools reach a template that does not render them in a system message (serve/tools.py)."""
    if isinstance(template, dict):
        return template.get("default") or next(iter(template.values()), None)
    return template


class Tokenizer:
    """A thin wrapper over a transformers tokenizer with the few calls the engine makes."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None):
        self.hf = hf_tokenizer
        ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(ids))
        self.chat_template = chat_template or _one_template(getattr(hf_tokenizer, "chat_template", None))
        self.vocab_size = len(hf_tokenizer)
        self._specials = set(getattr(hf_tokenizer, "all_special_ids", []) or [])
        self._token_texts: dict[int, str] = {}   # token_text's, as they are asked for
        # tokenizers' native stream decoder, where it streams what ``decode`` gives (decided here, once)
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._decode_stream: Any = _native_decode_stream(self)
        # how a token's string maps back to the bytes it stands for (decided here, once); added
        # tokens (special or not) are stored as their text, not in the model's byte alphabet
        self._piece_bytes = _piece_bytes_rule(self)
        self._added_bytes = {int(i): str(getattr(t, "content", t)).encode()
                             for i, t in (getattr(hf_tokenizer, "added_tokens_decoder", None) or {}).items()}

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``. With ``max_tokens``, a text too long to fit is refused before
        it is tokenized (ValueError): tokenizing megabytes takes seconds."""
        if max_tokens is not None:
            self.check_length(text, max_tokens)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters one token can stand for, where that bounds tokens from below:
        a fast tokenizer without a normalizer (one that may delete characters) whose vocabulary
        spells each token with at least as many characters as it decodes to (byte-level BPE and
        SentencePiece do). None where no such bound is known."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        return max((len(t) for t in self.hf.get_vocab()), default=0) or None

    def check_length(self, text: str, max_tokens: int) -> None:
        """Raise ValueError if ``text`` must tokenize to more than ``max_tokens`` tokens."""
        per_token = self.max_chars_per_token
        if per_token is not None and len(text) > max_tokens * per_token:
            raise ValueError(f"the text has {len(text)} characters, more than {max_tokens} tokens can hold "
                             f"(a token of this vocabulary spans at most {per_token} characters)")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool, context: list[int]) -> tuple[Any, Any, int] | None:
        """A native stream decoder that continues ``context``: (the stream, the tokenizer it steps
        with, where in ``context`` its prefill starts). The prefill is the last 5 tokens or fewer,
        the longest that decodes to whole characters (one that starts inside a character would
        misplace the stream's first text). None where this tokenizer has no stream that gives
        what ``decode`` gives, or where the context ends inside a character."""
        if self._decode_stream is None:
            return None
        for start in range(max(0, len(context) - 5), len(context) + 1):
            if start == len(context) or "\ufffd" not in self.decode(context[start:], skip_special_tokens):
                break
        if start == len(context) and context:
            return None
        return self._decode_stream(ids=context[start:], skip_special_tokens=skip_special_tokens), self._backend, start

    def is_special(self, token_id: int) -> bool:
        return token_id in self._specials

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tokenize: bool = False, **kwargs: Any) -> str:
        """The chat as text (``encode_chat`` gives its token ids)."""
        if tokenize:
            raise ValueError("tokenize=True: Tokenizer.encode_chat gives a chat's token ids")
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template")
        return self.hf.apply_chat_template(messages, tokenize=False, chat_template=template,
                                           add_generation_prompt=add_generation_prompt, **kwargs)

    def special_strings(self) -> list[str]:
        """Texts of the special tokens (control tokens the chat template places)."""
        if not hasattr(self, "_special_strings"):
            found = set(getattr(self.hf, "all_special_tokens", []) or [])
            for tok in getattr(self.hf, "added_tokens_decoder", {}).values():
                if getattr(tok, "special", False):
                    found.add(str(tok.content if hasattr(tok, "content") else tok))
            self._special_strings = sorted((t for t in found if t), key=len, reverse=True)
        return self._special_strings

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> list[int]:
        """Token ids of a chat. Control tokens come only from the template: text inside a
        message that spells one (e.g. "<|im_end|>") is tokenized as plain text. With
        ``max_tokens``, a chat too long to fit is refused before it is tokenized."""
        return self.render_chat(messages, add_generation_prompt, chat_template, max_tokens, **kwargs)[1]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None, max_tokens: int | None = None,
                    **kwargs: Any) -> tuple[str, list[int]]:
        """A chat's text as the template renders it, and its token ids (``encode_chat``), from
        one rendering."""
        specials = self.special_strings()
        contents = [m.get("content") or "" for m in messages]
        if not any(sp in c for c in contents if isinstance(c, str) for sp in specials):
            text = self.apply_chat_template(messages, add_generation_prompt, chat_template, **kwargs)
            return text, self.encode(text, add_special_tokens=False, max_tokens=max_tokens)
        if max_tokens is not None:
            self.check_length("".join(c for c in contents if isinstance(c, str)), max_tokens)
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        masked = [dict(m, content=mark) for m, mark in zip(messages, marks, strict=True)]
        rest = self.apply_chat_template(masked, add_generation_prompt, chat_template, **kwargs)
        ids: list[int] = []
        pieces: list[str] = []
        for i, mark in enumerate(marks):
            before, _, rest = rest.partition(mark)
            ids += self.encode(before, add_special_tokens=False)
            ids += self.hf(contents[i], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            pieces += [before, contents[i]]
        return "".join(pieces) + rest, ids + self.encode(rest, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprob listings), decoded once a token."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.hf.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for, also where it holds part of a character (whose
        ``token_text`` is U+FFFD): byte-level BPE tokens through the byte alphabet, SentencePiece
        pieces with ``▁`` as a space and byte-fallback pieces (``<0xF0>``) as their byte; added
        tokens, and other tokenizers' tokens, as their text."""
        if token_id in self._added_bytes:
            return self._added_bytes[token_id]
        piece = self.hf.convert_ids_to_tokens(token_id)
        if self._piece_bytes is None or not isinstance(piece, str) or token_id in self._specials:
            return self.token_text(token_id).encode()
        try:
            return self._piece_bytes(piece)
        except KeyError:   # a character outside the byte alphabet: not a byte-level piece after all
            return self.token_text(token_id).encode()


def _byte_level_bytes(piece: str) -> bytes:
    return bytes(_BYTE_ALPHABET[c] for c in piece)


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character that stands for each byte."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in shown}
    n = 0
    for b in range(256):
        if b not in shown:
            table[chr(256 + n)] = b
            n += 1
    return table


_BYTE_ALPHABET = _gpt2_byte_alphabet()
_BYTE_PROBE = "naïve café — 🍕 中文"


def _piece_bytes_rule(tok: Tokenizer) -> Callable[[str], bytes] | None:
    """How the tokenizer's token strings map to bytes, if either rule gives back a probe's bytes
    from its tokens (leading spaces aside: SentencePiece marks the start of text)."""
    try:
        pieces = tok.hf.convert_ids_to_tokens(tok.encode(_BYTE_PROBE, add_special_tokens=False))
    except (TypeError, ValueError, KeyError):
        return None
    if not all(isinstance(p, str) for p in pieces):
        return None
    if all(c in _BYTE_ALPHABET for p in pieces for c in p) and \
            b"".join(map(_byte_level_bytes, pieces)) == _BYTE_PROBE.encode():
        return _byte_level_bytes
    if b"".join(map(_sentencepiece_bytes, pieces)).lstrip(b" ") == _BYTE_PROBE.encode():
        return _sentencepiece_bytes
    return None


def load_tokenizer(source: Any, tokenizer: str | None = None, trust_remote_code: bool = False) -> Tokenizer:
    """The tokenizer of a ``ModelSource`` (or of the directory ``tokenizer`` when given)."""
    from transformers import AutoTokenizer
    eos = tuple(source.config.eos_token_ids)
    if tokenizer is not None:
        hf = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    elif source.kind == "gguf":
        hf = _gguf_tokenizer(source.path)
    else:
        hf = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
        eos = eos + _generation_config_eos(source.path)
    return Tokenizer(hf, eos)


# what the native stream decoder must stream as ``decode`` does before it is used: several-byte
# characters split across tokens, spaces, a newline, and what transformers' clean-up rewrites
_STREAM_PROBE = "Ünïcödé 日本語 😀👍🏽 façade , don't . it 's\n  x ?"


def _native_decode_stream(tok: Tokenizer) -> Any:
    """``tokenizers.decoders.DecodeStream`` where it gives, on a probe with and without context
    and with special tokens kept or skipped, the text the two-decode window gives; else None."""
    if tok._backend is None or getattr(tok.hf, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream
        DecodeStream(ids=[], skip_special_tokens=True)   # a prefill needs tokenizers >= 0.22
    except (ImportError, TypeError):
        return None
    try:
        ids = tok.encode(_STREAM_PROBE, add_special_tokens=False)
        specials = sorted(tok._specials)[:2]
        ids = ids[:4] + specials + ids[4:] + specials
        for skip in (True, False):
            for context in ([], ids[:3]):
                window = IncrementalDetokenizer(tok, skip, context, native=False)
                want = "".join(window.add([t]) for t in ids[len(context):]) + window.flush()
                stream = DecodeStream(ids=context, skip_special_tokens=skip)
                got = "".join(p for t in ids[len(context):] if (p := stream.step(tok._backend, t)) is not None)
                if got != want:
                    return None
    except Exception:  # noqa: BLE001 - any failure of the probe keeps the window
        return None
    return DecodeStream


def _generation_config_eos(path: str) -> tuple[int, ...]:
    import json
    f = os.path.join(path, "generation_config.json")
    if not os.path.exists(f):
        return ()
    with open(f) as fh:
        eos = json.load(fh).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that concatenate to the full decode.

    Decodes a small window ``ids[prefix_offset:]`` and emits only what extends the window's
    already-emitted part; holds text back while it ends in an incomplete UTF-8 sequence
    (U+FFFD), so byte-fallback and multi-token characters never leak a replacement char.
    Where the tokenizer has a native stream decoder (``Tokenizer.decode_stream``: tokenizers'
    ``DecodeStream``, checked at load against this window) a token is one call into it, ~10×
    cheaper than the window's two decodes; the offsets are kept the same way, for ``flush``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: list[int] | None = None,
                 native: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(context or [])
        # start the window a few tokens back into the context so leading spaces decode right
        self.prefix_offset = max(0, len(self.ids) - 5)
        self.read_offset = len(self.ids)
        self._stream: tuple[Any, Any] | None = None
        found = tokenizer.decode_stream(skip_special_tokens, self.ids) if native else None
        if found is not None:
            self._stream, self.prefix_offset = found[:2], found[2]

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the new text (possibly empty)."""
        self.ids.extend(new_ids)
        if self._stream is not None:
            return self._add_streamed(self._stream, new_ids)
        return self._window()

    def _window(self) -> str:
        """What the tokens after ``read_offset`` add to the text, by two decodes of the window."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta

    def _add_streamed(self, native: tuple[Any, Any], new_ids: list[int]) -> str:
        stream, backend = native
        at = len(self.ids) - len(new_ids)
        pieces = []
        try:
            for k, tok in enumerate(new_ids, 1):
                piece = stream.step(backend, tok)
                if piece is not None:   # None: the token ends inside a character; held in the stream
                    pieces.append(piece)
                    self.prefix_offset, self.read_offset = self.read_offset, at + k
        except Exception:  # noqa: BLE001 - e.g. a byte-fallback run that re-decodes text already sent
            # (tokenizers' InvalidPrefix): the window goes on from the offsets, kept in step with the stream
            self._stream = None
            pieces.append(self._window())
        return "".join(pieces)

    def flush(self) -> str:
        """At the end: whatever is still held back (e.g. a truly invalid byte sequence)."""
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self._stream = None
        return delta
