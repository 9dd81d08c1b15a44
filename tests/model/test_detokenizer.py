"""Incremental detokenization equals a full decode: CJK, emoji (multi-token characters),
accents, and arbitrary token sequences; no U+FFFD is ever streamed for valid text. Both ways
are checked: tokenizers' native stream decoder (what the bundled tokenizer uses) and the
two-decode window it falls back to."""

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


def test_the_bundled_tokenizer_streams_natively(tok):
    assert tok.decode_stream(True, [19556, 905]) is not None
    assert IncrementalDetokenizer(tok, context=[19556, 905])._stream is not None


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("context", [[], [19556, 905]])
def test_streamed_text_equals_full_decode(tok, text, context, native):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, skip_special_tokens=True, context=context, native=native)
    deltas = [d.add([t]) for t in ids]
    deltas.append(d.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in x for x in deltas)


@pytest.mark.parametrize("native", [True, False])
def test_random_token_sequences_add_up(tok, native):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(tok, skip_special_tokens=True, native=native)
        out, i = [], 0
        while i < len(ids):
            k = rng.randrange(1, 4)
            out.append(d.add(ids[i:i + k]))
            i += k
        out.append(d.flush())
        assert "".join(out) == tok.decode(ids)


@pytest.mark.parametrize("native", [True, False])
def test_special_tokens_skipped_or_kept(tok, native):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip, native=native)
        got = "".join(d.add([t]) for t in ids) + d.flush()
        assert got == tok.decode(ids, skip_special_tokens=skip)


def test_the_native_stream_gives_the_window_text_after_any_context(tok):
    """After every cut of a text with characters split across tokens, the stream continues the
    context as the window does: where the context ends inside a character, the window is used."""
    text = "Ünïcödé ✓ 日本語のテキスト 😀👍🏽 and code: f(x) ?\n" * 3
    ids = tok.encode(text, add_special_tokens=False)
    native_cuts = 0
    for cut in range(len(ids)):
        streamed = IncrementalDetokenizer(tok, context=ids[:cut])
        window = IncrementalDetokenizer(tok, context=ids[:cut], native=False)
        native_cuts += streamed._stream is not None
        got = [streamed.add(ids[i:i + 2]) for i in range(cut, len(ids), 2)] + [streamed.flush()]
        want = [window.add(ids[i:i + 2]) for i in range(cut, len(ids), 2)] + [window.flush()]
        assert "".join(got) == "".join(want), cut
    assert native_cuts > len(ids) // 2


def _byte_fallback_tokenizer(metaspace: bool):
    """A SentencePiece-style BPE with byte fallback (the Llama-2 / Mistral layout, or Metaspace)."""
    import json

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from phalanx.llmapi.tokenizer import Tokenizer
    t = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if metaspace:
        t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                  prepend_scheme="first")])
    else:
        t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    corpus = ["Hello world, the quick brown fox jumps over the lazy dog.", "Ünïcödé façade naïve café",
              "def f(x): return x + 1\n  indented", "日本語 テキスト 😀 👍🏽"] * 20
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                      limit_alphabet=60))
    spec = json.loads(t.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    vocab.update({f"<0x{i:02X}>": base + i for i in range(256)})
    hf = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                 eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    return Tokenizer(hf)


@pytest.mark.parametrize("metaspace", [False, True])
def test_byte_fallback_runs_that_do_not_decode_stream_as_the_window_does(metaspace):
    """Bytes that make no character re-decode text already sent as U+FFFD: tokenizers' stream
    refuses that (InvalidPrefix), and the request goes on through the window, never failing."""
    tok = _byte_fallback_tokenizer(metaspace)
    assert tok.decode_stream(True, []) is not None          # valid text passes the load-time probe
    byte = {b: tok.hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0x0A, 0x97, 0xE6)}
    head, tail = tok.encode("Hello world, the", add_special_tokens=False), tok.encode(" quick fox",
                                                                                      add_special_tokens=False)
    rng = random.Random(1)
    cases = [head + [byte[0x0A], byte[0xE6], byte[0x97]] + tail, head + [byte[0x97]] + tail,
             head + [byte[0xE6]] + tail[:1] + [byte[0x97]] + tail[1:]]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(200)]
    context = tok.encode("Q: hi", add_special_tokens=True)
    for ids in cases:
        for skip in (True, False):
            streamed = IncrementalDetokenizer(tok, skip, context)
            window = IncrementalDetokenizer(tok, skip, context, native=False)
            got = "".join(streamed.add([t]) for t in ids) + streamed.flush()
            assert got == "".join(window.add([t]) for t in ids) + window.flush(), ids


@pytest.mark.parametrize("which", ["bundled", "byte_fallback", "metaspace"])
def test_token_bytes_join_into_the_texts_bytes(tok, which):
    """A token's own bytes (logprobs' ``bytes``), also for tokens that hold part of a character:
    byte-level BPE through its byte alphabet, SentencePiece pieces and byte-fallback pieces."""
    t = tok if which == "bundled" else _byte_fallback_tokenizer(which == "metaspace")
    split = 0
    for text in TEXTS:
        ids = t.encode(text, add_special_tokens=False)
        assert b"".join(t.token_bytes(i) for i in ids).lstrip(b" ") == text.encode().lstrip(b" "), text
        split += sum(t.token_text(i) == "\ufffd" for i in ids)
    assert split   # some tokens were parts of characters


def test_added_tokens_bytes_are_their_text(tok):
    """Tokens added to a vocabulary (special or not: DeepSeek-R1-Distill's '<｜User｜>' is not
    special) are stored as text, outside the byte alphabet: their bytes are that text's."""
    import copy

    from phalanx.llmapi.tokenizer import Tokenizer
    hf = copy.deepcopy(tok.hf)
    added = ["<｜User｜>", "  x y", "café!"]
    hf.add_tokens(added)
    t = Tokenizer(hf)
    for text in added:
        assert t.token_bytes(hf.convert_tokens_to_ids(text)) == text.encode()
    assert t.token_bytes(t.eos_token_ids[0]) == tok.token_text(t.eos_token_ids[0]).encode()


@pytest.mark.parametrize("metaspace", [False, True])
def test_echoed_prompt_offsets_skip_what_the_tokens_hold_beyond_the_text(metaspace):
    """completions' text_offset over an echoed prompt whose tokens start with a BOS and
    SentencePiece's start-of-text space: each token's text is found at its offset."""
    from phalanx.serve.openai_server import _TextOffsets
    tok = _byte_fallback_tokenizer(metaspace)
    text = "Hello world, naïve café 😀"
    ids = [tok.hf.bos_token_id, *tok.encode(text, add_special_tokens=False)]
    pieces = [tok.token_bytes(i) for i in ids]
    offsets = _TextOffsets.echoing(text, pieces)
    at = [offsets.advance(b) for b in pieces]
    assert at[:2] == [0, 0] and at == sorted(at)
    for b, off in zip(pieces[1:], at[1:], strict=True):
        piece = b.decode(errors="ignore").lstrip(" ") if off == 0 else b.decode(errors="ignore")
        assert text.startswith(piece, off), (piece, off)
