"""The body checks before validation (protocol.parse_body): a token-id prompt's thousands of
numbers skip the per-value walk, which still finds what it is for — nesting past MAX_DEPTH and
strings that are not valid Unicode — wherever they are."""

import json

import pytest

from phalanx.serve.protocol import MAX_DEPTH, BodyError, CompletionRequest, parse_body


def _body(prompt) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2}).encode()


def test_a_token_id_prompt_passes_whole():
    ids = list(range(5, 2085))
    assert parse_body(_body(ids), CompletionRequest).prompt == ids


def test_numbers_nested_too_deep_are_refused():
    deep: list = [1, 2, 3]
    for _ in range(MAX_DEPTH):
        deep = [deep]
    with pytest.raises(BodyError, match="nested deeper"):
        parse_body(_body(deep), CompletionRequest)


def test_a_lone_surrogate_among_numbers_is_named_by_its_path():
    raw = b'{"model": "m", "max_tokens": 2, "prompt": [[1, 2], [3, "\\ud800"]]}'
    with pytest.raises(BodyError, match="lone surrogate") as e:
        parse_body(raw, CompletionRequest)
    assert e.value.param == "prompt.1.1"


@pytest.mark.parametrize("wrappers", range(MAX_DEPTH - 3, MAX_DEPTH + 2))
def test_numbers_at_every_depth_near_the_limit_get_the_walks_answer(wrappers, monkeypatch):
    """The fast path for lists of numbers refuses exactly what the walk over each number does,
    at the depth limit and on either side of it."""
    from phalanx.serve import protocol
    deep: list = [1, 2, 3]
    for _ in range(wrappers):
        deep = [deep]

    def outcome() -> str:
        try:
            parse_body(_body(deep), CompletionRequest)
        except BodyError as e:
            return "depth" if "nested deeper" in e.message else "other"
        return "ok"

    fast = outcome()
    monkeypatch.setattr(protocol, "_numbers_only", lambda items: False)
    assert fast == outcome()
    assert fast == ("depth" if wrappers >= MAX_DEPTH - 1 else "other")
