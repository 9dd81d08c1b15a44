"""Grammars for guided decoding: xgrammar compiles a ``GuidedDecodingParams`` against the model's
vocabulary into a ``CompiledGrammar`` (token masks, cached by the constraint's text).

Used in the user process, to refuse a constraint that does not compile with a ValueError naming
the field before anything is submitted, and on the ranks, which run it (pyexecutor/guided_decoder.py).
JSON schemas compile strictly and without free whitespace (compact JSON: a small model cannot
wander into endless blanks); ``json_object`` is the schema ``{"type": "object"}``; ``choice``
is a grammar of its literal alternatives.
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
    step's fill 12 times slower than the 49k real ones alone)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], threads: int = 4) -> None:
        import xgrammar as xgr
        ids = hf_tokenizer.get_vocab().values()
        self.vocab_size = min(vocab_size, max(len(ids), max(ids, default=-1) + 1))
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The CompiledGrammar of ``params``; ValueError naming the field if it does not compile."""
        kind = params.kind
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(json.dumps(params.json), any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex or "")
            if kind == "grammar":
                return self.compiler.compile_grammar(params.grammar or "")
            return self.compiler.compile_grammar(choice_grammar(params.choice or []))
        except (RuntimeError, ValueError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = _SOURCE_PREFIX.sub("", first)      # "[time] file.cc:94: message" -> "message"
            raise ValueError(f"guided_decoding.{kind} does not compile: {first[:300]}") from None


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
