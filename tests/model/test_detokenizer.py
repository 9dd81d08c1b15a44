"""Incremental detokenization equals a full decode: CJK, emoji (multi-token characters),
accents, and arbitrary token sequences; no U+FFFD is ever streamed for valid text."""

import random

import pytest

from phalanx.llmapi.tokenizer import IncrementalDetokenizer, load_tokenizer
from phalanx.models.source import resolve_model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


TEXTS = [
    "日本語のテキスト、漢字とひらがなとカタカナ。",
    "中文测试：你好，世界！",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 in one line.",
    "Ünïcödé façade — naïve café, ñandú, Ελληνικά, русский.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "<|im_start|> is text here, not a control token",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("context", [[], [19556, 905]])
def test_streamed_text_equals_full_decode(tok, text, context):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, skip_special_tokens=True, context=context)
    deltas = [d.add([t]) for t in ids]
    deltas.append(d.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in x for x in deltas)


def test_random_token_sequences_add_up(tok):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(tok, skip_special_tokens=True)
        out, i = [], 0
        while i < len(ids):
            k = rng.randrange(1, 4)
            out.append(d.add(ids[i:i + k]))
            i += k
        out.append(d.flush())
        assert "".join(out) == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        got = "".join(d.add([t]) for t in ids) + d.flush()
        assert got == tok.decode(ids, skip_special_tokens=skip)
