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


def test_iteration_input_round_trips_through_msgpack():
    sp = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, stop=["\n"], logit_bias={3: -1.5})
    msg = IterationInput(new=[GenerationRequest(7, [1, 2, 3], sp.to_dict(), [2], 40, "salt")],
                         cancel=[4, 5], shutdown=False)
    back = unpack(pack(msg))
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
    back = unpack(pack(msg))
    assert back == msg
    assert isinstance(back.new[0], GenerationRequest) and isinstance(back.control[0], Control)
    assert back.new[0].sampling_params["x"] == lookalike and back.control[0].args["y"] == [lookalike]
    tb = TokenBatch([1, 2], [5, [6, 7]])
    assert unpack(pack(tb)) == tb
