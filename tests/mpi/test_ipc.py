"""The proxy <-> rank 0 channel: signed frames, checked before decoding; private sockets."""

import dataclasses
import os
import stat
import time

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
    got = b.get(timeout_ms=2000)
    assert got.prompt_token_ids.tolist() == [1, 2, 3]            # crossed as uint32 bytes
    assert dataclasses.replace(got, prompt_token_ids=[1, 2, 3]) == msg


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


def test_rank0s_loop_reads_the_users_socket_itself(monkeypatch):
    """Rank 0's request source is the socket, read by the loop's fetch: everything the user sent
    comes in one fetch, in order and sorted by kind, nothing past a shutdown; an idle fetch with
    nothing sent waits its timeout and returns empty; a user process that is gone ends the job."""
    from phalanx.executor.messages import Control, Shutdown
    from phalanx.pyexecutor.worker import Rank0Link
    d, key = ipc.private_dir(), ipc.new_key()
    req, resp = ipc.ipc_addresses(d)
    user_req, user_resp = ipc.IpcQueue(req, key, bind=True), ipc.IpcQueue(resp, key, bind=True)
    monkeypatch.setenv(ipc.KEY_ENV, key.hex())
    monkeypatch.setenv(ipc.REQUEST_ADDR_ENV, req)
    monkeypatch.setenv(ipc.RESPONSE_ADDR_ENV, resp)
    alive = [True]
    link = Rank0Link(lambda: alive[0])
    try:
        t0 = time.monotonic()
        assert not link.fetch(idle=True, timeout=0.05)               # nothing sent: waits, returns empty
        assert time.monotonic() - t0 >= 0.04
        sent = [GenerationRequest(1, [5, 6], {}), CancelRequest(7), Control("stats", 3), GenerationRequest(2, [8], {}),
                Shutdown(), GenerationRequest(3, [9], {})]
        for m in sent:
            user_req.put(m)
        new, cancel, control = [], [], []
        deadline = time.monotonic() + 30
        while True:   # non-blocking reads until the shutdown is read (delivery takes its time on a busy machine)
            got = link.fetch(idle=False)
            new, cancel, control = new + got.new, cancel + got.cancel, control + got.control
            if got.shutdown or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert [r.request_id for r in new] == [1, 2] and cancel == [7]
        assert control == [Control("stats", 3)] and got.shutdown
        assert [r.request_id for r in link.fetch(idle=True, timeout=0.5).new] == [3]   # read after the shutdown
        alive[0] = False
        link._last_check -= Rank0Link.ALIVE_CHECK_S
        assert link.fetch(idle=False).shutdown                        # the user process is gone
    finally:
        user_req.close()
        user_resp.close()
        link.requests.close()
        link.sender.queue.close()
