"""Grammars for guided decoding: xgrammar compiles a ``GuidedDecodingParams`` against the model's
vocabulary into a ``CompiledGrammar`` (token masks, cached by the constraint's text).

Used in the user process, to refuse a constraint that does not compile with a ValueError naming
the field before anything is submitted, and on the ranks, which run it (pyexecutor/guided_decoder.py).
JSON schemas compile strictly and without free whitespace (compact JSON: a small model cannot
wander into endless blanks); ``json_object`` is the schema ``{"type": "object"}``; ``choice``
is a grammar of its literal alternatives; a structural tag compiles as xgrammar reads it (the
JSON schemas inside it checked as the ``json`` ones are).
"""

from __future__ import annotations

import json
import re
from typing import Any

from phalanx.llmapi.sampling_params import GuidedDecodingParams

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarCompiler:
    """xgrammar's compiler for one vocabulary (built from a Hugging Face tokenizer).

    Its masks cover ``vocab_size`` = the smaller of the model's and the tokenizer's vocabularies:
    ids a model pads its output layer with have no text, so no grammar allows them, and the
    sampler masks them without the grammar engine (fed through it, 79k padding ids made each
    step's fill 12 times slower than the 49k real ones alone).

    The tokenizer's special tokens (``special_ids``) but the stop tokens and the tool-call markers
    (``MARKERS``: a tools grammar must let the model write the token it was trained to open a call
    with) are given no text, which xgrammar reads as a token no grammar allows: otherwise it
    matches a special token as its literal text (``<|eot_id|>`` inside a JSON string), which
    decoding then skips, and the output the user gets breaks the grammar (a string shorter than
    its minLength, a tool call after a special token the parser never sees)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], threads: int = 4) -> None:
        import xgrammar as xgr
        vocab = hf_tokenizer.get_vocab()
        self.vocab_size = min(vocab_size, max(len(vocab), max(vocab.values(), default=-1) + 1))
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        stops = list(self.info.stop_token_ids)     # as given, or as xgrammar found them by their text
        unmatchable = special_ids(hf_tokenizer) - set(stops) - {vocab[m] for m in MARKERS if m in vocab}
        if unmatchable:
            encoded = [""] * self.vocab_size
            for text, i in vocab.items():
                if i < self.vocab_size and i not in unmatchable:
                    encoded[i] = text
            self.info = xgr.TokenizerInfo(encoded, self.info.vocab_type, vocab_size=self.vocab_size,
                                          stop_token_ids=stops, add_prefix_space=self.info.add_prefix_space)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The CompiledGrammar of ``params``; ValueError naming the field if it does not compile."""
        kind = params.kind
        if kind == "json":
            check_enforced(params.json, "")
        elif kind == "structural_tag":
            _check_tag_schemas(params.structural_tag, "")
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(json.dumps(params.json), any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex or "")
            if kind == "grammar":
                return self.compiler.compile_grammar(params.grammar or "")
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(json.dumps(params.structural_tag))
            return self.compiler.compile_grammar(choice_grammar(params.choice or []))
        except (RuntimeError, ValueError, TypeError, _xgrammar_error()) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = _SOURCE_PREFIX.sub("", first)      # "[time] file.cc:94: message" -> "message"
            raise ValueError(f"guided_decoding.{kind} does not compile: {first[:300]}") from None


# the tool-call parsers' (serve/tools.py): Hermes', Llama 3's, DeepSeek's, Kimi K2's
MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
           "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<|tool_calls_section_begin|>",
           "<|tool_calls_section_end|>", "<|tool_call_section_begin|>", "<|tool_call_section_end|>",
           "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")


def special_ids(hf_tokenizer: Any) -> set[int]:
    """The ids of a Hugging Face tokenizer's special tokens: its named ones (bos, eos, pad, ...)
    and every added token marked special (which decoding skips by default)."""
    ids = set(getattr(hf_tokenizer, "all_special_ids", None) or [])
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
    return ids | {i for i, tok in decoder.items() if getattr(tok, "special", False)}


# JSON-schema keywords the grammar engine does not enforce (an output it allows may break them):
# refused by name rather than ignored. "uniqueItems": false constrains nothing and is let through.
UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "allOf", "dependentRequired",
                       "dependentSchemas")
# where a schema holds subschemas: one, a list of them, or a mapping of names to them
_ONE = ("additionalProperties", "items", "not", "contains", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _xgrammar_error() -> type[Exception]:
    """xgrammar's error for a structural tag it cannot read (a ValueError in some versions)."""
    import xgrammar as xgr
    return getattr(xgr, "InvalidStructuralTagError", ValueError)


def _check_tag_schemas(tag: Any, at: str) -> None:
    """``check_enforced`` on every JSON schema a structural tag holds (``"type": "json_schema"``)."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            try:
                check_enforced(tag["json_schema"], f"{at}/json_schema")
            except ValueError as e:
                raise ValueError(str(e).replace("guided_decoding.json:", "guided_decoding.structural_tag:")) from None
        for key, sub in tag.items():
            _check_tag_schemas(sub, f"{at}/{key}")
    elif isinstance(tag, list):
        for i, sub in enumerate(tag):
            _check_tag_schemas(sub, f"{at}/{i}")


def check_enforced(schema: Any, at: str) -> None:
    """ValueError naming the first keyword of ``UNENFORCED_KEYWORDS`` in ``schema`` and where it is."""
    if not isinstance(schema, dict):
        return
    for key in UNENFORCED_KEYWORDS:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            raise ValueError(f"guided_decoding.json: the keyword {key!r}{f' (at {at})' if at else ''} is not "
                             "enforced by the grammar engine; refused rather than ignored")
    for key in _ONE:
        check_enforced(schema.get(key), f"{at}/{key}")
    for key in _MANY:
        for i, sub in enumerate(schema.get(key) or () if isinstance(schema.get(key), list) else ()):
            check_enforced(sub, f"{at}/{key}/{i}")
    for key in _NAMED:
        named = schema.get(key)
        if isinstance(named, dict):
            for name, sub in named.items():
                check_enforced(sub, f"{at}/{key}/{name}")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(_literal(c) for c in choices)


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal: double quotes, backslash escapes, \\xNN for controls."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
