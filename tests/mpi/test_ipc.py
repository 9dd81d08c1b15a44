"""The proxy <-> rank 0 channel: signed frames, checked before decoding; private sockets."""

import os
import stat

import pytest

from phalanx.executor import ipc, messages
from phalanx.executor.messages import CancelRequest, GenerationRequest


@pytest.fixture
def pair():
    d = ipc.private_dir()
    key = ipc.new_key()
    req, _ = ipc.ipc_addresses(d)
    a = ipc.IpcQueue(req, key, bind=True)
    b = ipc.IpcQueue(req, key, bind=False)
    yield a, b, d
    a.close()
    b.close()


def test_round_trip(pair):
    a, b, _ = pair
    msg = GenerationRequest(1, [1, 2, 3], {"max_tokens": 4})
    a.put(msg)
    assert b.get(timeout_ms=2000) == msg


def test_frames_with_missing_or_wrong_tag_are_dropped_before_decoding(pair, monkeypatch):
    a, b, _ = pair
    decoded = []
    real = messages.unpack
    monkeypatch.setattr(messages, "unpack", lambda data: decoded.append(data) or real(data))
    payload = messages.pack(CancelRequest(5))
    a.socket.send(payload)                                   # no tag at all
    a.socket.send(b"\x01")                                   # shorter than a tag
    a.socket.send(payload + b"\x00" * ipc.TAG_BYTES)         # wrong tag
    a.socket.send(ipc.sign(ipc.new_key(), payload))          # signed with another key
    a.put(CancelRequest(6))                                  # the real one
    assert b.get(timeout_ms=2000) == CancelRequest(6)
    assert b.num_dropped == 4
    assert decoded == [messages.pack(CancelRequest(6))]     # only the authentic frame was decoded


def test_socket_directory_is_private(pair):
    _, _, d = pair
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    sock = os.path.join(d, "requests")
    assert stat.S_IMODE(os.stat(sock).st_mode) & 0o077 == 0


def test_short_key_refused():
    with pytest.raises(ValueError):
        ipc.IpcQueue("ipc:///tmp/never", b"short", bind=False)
