import dataclasses
from array import array

import pytest

from phalanx.executor.messages import (
    CancelRequest,
    GenerationRequest,
    IterationInput,
    Response,
    pack,
    unpack,
)
from phalanx.llmapi.sampling_params import SamplingParams


def listed(msg: IterationInput) -> IterationInput:
    """msg with its requests' token ids as lists (they come off the wire as array("I"))."""
    for r in msg.new:
        assert isinstance(r.prompt_token_ids, array) and r.prompt_token_ids.typecode == "I"
    return dataclasses.replace(msg, new=[dataclasses.replace(r, prompt_token_ids=r.prompt_token_ids.tolist())
                                         for r in msg.new])


def test_iteration_input_round_trips_through_msgpack():
    sp = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, stop=["\n"], logit_bias={3: -1.5})
    msg = IterationInput(new=[GenerationRequest(7, [1, 2, 3], sp.to_dict(), [2], 40, "salt")],
                         cancel=[4, 5], shutdown=False)
    back = listed(unpack(pack(msg)))
    assert back == msg
    assert SamplingParams.from_dict(back.new[0].sampling_params) == sp


def test_response_and_cancel_round_trip():
    for msg in (Response(3, [10, 11], [[-0.1, [[10, -0.1], [12, -2.0]]]], "stop", 11, 5, 9),
                CancelRequest(9), [Response(1), Response(2, error="boom")]):
        assert unpack(pack(msg)) == msg


def test_unknown_tags_are_plain_data_not_classes():
    import msgpack
    data = msgpack.packb({"t": "os.system", "b": {"cmd": "true"}})
    assert unpack(data) == {"t": "os.system", "b": {"cmd": "true"}}


def test_pack_refuses_arbitrary_objects():
    with pytest.raises(TypeError):
        pack(object())


def test_only_fields_that_hold_messages_are_decoded_as_messages():
    """An iteration's requests and controls come back as messages; a value inside a plain field
    (sampling settings, a control's args) stays the plain value it was, even when it looks like
    a message on the wire."""
    from phalanx.executor.messages import Control, TokenBatch
    lookalike = {"t": "cancel", "b": {"request_id": 3}}
    msg = IterationInput(new=[GenerationRequest(1, list(range(3000)), {"x": lookalike})],
                         control=[Control("stats", 2, {"y": [lookalike]})])
    back = listed(unpack(pack(msg)))
    assert back == msg
    assert isinstance(back.new[0], GenerationRequest) and isinstance(back.control[0], Control)
    assert back.new[0].sampling_params["x"] == lookalike and back.control[0].args["y"] == [lookalike]
    tb = TokenBatch([1, 2], [5, [6, 7]])
    assert unpack(pack(tb)) == tb


def test_prompt_ids_cross_as_uint32_bytes_and_only_in_range_ids_do():
    """A prompt's ids cross as one bin of little-endian uint32 (not 2k msgpack ints), come back
    as array("I"), and the rank's check of them only compares with the vocabulary; ids that do
    not fit (negative, past 32 bits, not integers) cross as a list for the full check to name."""
    import msgpack

    from phalanx.executor.messages import ids_from_wire
    from phalanx.llmapi.sampling_params import check_prompt
    ids = [0, 1, 70000, 2**32 - 1]
    wire = msgpack.unpackb(pack(GenerationRequest(1, ids, {})))
    assert wire["b"]["prompt_token_ids"] == b"".join(i.to_bytes(4, "little") for i in ids)
    back = unpack(pack(GenerationRequest(1, ids, {})))
    assert back.prompt_token_ids == array("I", ids) and back.prompt_token_ids.tolist() == ids
    check_prompt(array("I", [0, 99]), 100, 10)
    with pytest.raises(ValueError, match=r"token id 100 is outside the vocabulary \[0, 100\)"):
        check_prompt(array("I", [5, 100, 3]), 100, 10)
    for bad in ([1, -1], [1, 2**32], [1, 2.0]):
        back = unpack(pack(GenerationRequest(1, bad, {})))
        assert back.prompt_token_ids == bad and type(back.prompt_token_ids) is list
        with pytest.raises(ValueError, match="prompt_token_ids: token id"):
            check_prompt(back.prompt_token_ids, 100, 10)
    # bytes that are not whole uint32 ids (no proxy sends them) come off as they are, cross to
    # the other ranks as they are, and fail the rank's check of that request, naming the field
    assert ids_from_wire(b"\x01\x02\x03") == b"\x01\x02\x03"
    raw = msgpack.unpackb(pack(GenerationRequest(1, [1], {})))
    raw["b"]["prompt_token_ids"] = b"\x01\x02\x03"
    odd = unpack(msgpack.packb(raw))
    assert odd.prompt_token_ids == b"\x01\x02\x03" and unpack(pack(odd)) == odd
    with pytest.raises(ValueError, match="prompt_token_ids: 3 bytes are not a sequence of uint32 token ids"):
        check_prompt(odd.prompt_token_ids, 100, 10)


def test_what_came_off_the_wire_crosses_again_unchanged():
    """Rank 0 keeps the iteration's input it read from the socket and broadcasts it packed: the
    other ranks must unpack what rank 0 holds, whatever a client of the socket sent (ids out of
    range, bytes that are not whole ids, a string or a map for ids, odd settings), or the ranks
    would schedule different requests."""
    from phalanx.executor.messages import Control
    sp = SamplingParams(max_tokens=5, temperature=0.7, stop=["\n"], logit_bias={3: -1.5}).to_dict()
    sent = IterationInput(new=[GenerationRequest(1, [1, 2, 3], sp, [2], 40, "salt", 7, 1.5),
                               GenerationRequest(2, [-1, 2**40, 3], {}),
                               GenerationRequest(3, [1.5, "x"], {"n": None}),   # type: ignore[list-item]
                               GenerationRequest(4, b"\x01\x02\x03", {})],
                          cancel=[9], control=[Control("stats", 2, {"y": [1, {"z": None}]})])
    rank0 = unpack(pack(sent))               # what rank 0 read
    others = unpack(pack(rank0))             # what every other rank gets from it
    assert others == rank0
    assert [type(r.prompt_token_ids) for r in others.new] == [type(r.prompt_token_ids) for r in rank0.new]
    import msgpack

    from phalanx.executor.messages import _TAGS
    for ids in (["a", "b"], "abc", {1: 2, 3: 4}, [1, 2], [True, 1], 5, None, [1.5], [-1, 2**40], b"\x01\x02\x03"):
        frame = msgpack.packb({"t": _TAGS[GenerationRequest], "b": {"request_id": 1, "prompt_token_ids": ids,
                                                                      "sampling_params": {}}}, use_bin_type=True)
        rank0_req = unpack(frame)            # what a raw client of the socket sent, as rank 0 read it
        again = unpack(pack(rank0_req))
        assert again == rank0_req and type(again.prompt_token_ids) is type(rank0_req.prompt_token_ids), ids
