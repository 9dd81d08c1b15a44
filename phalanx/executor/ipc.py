"""ZMQ PAIR queues between the user process and rank 0: msgpack payloads, each frame signed.

Frame = payload ‖ HMAC-SHA256(key, payload) (32 bytes). The receiver checks the tag with a
constant-time compare *before* decoding anything; a frame with a missing or wrong tag is
dropped and counted, never decoded. Payloads are msgpack (``messages.pack``): no pickle, no
class loading. Sockets live on ``ipc://`` inside a private 0700 directory (or 127.0.0.1).

A socket is used by one thread only (ZMQ sockets are not thread-safe): the owner of the queue
decides which thread that is.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import tempfile
from typing import Any

import zmq

from phalanx.executor import messages

logger = logging.getLogger("phalanx")

TAG_BYTES = 32
KEY_ENV = "PHALANX_IPC_KEY"
REQUEST_ADDR_ENV = "PHALANX_IPC_REQUEST_ADDR"
RESPONSE_ADDR_ENV = "PHALANX_IPC_RESPONSE_ADDR"
PROXY_PID_ENV = "PHALANX_PROXY_PID"
DIR_ENV = "PHALANX_IPC_DIR"            # the proxy's private directory (torch.distributed's file store, MPI files)
FATAL_MARKER = "PHALANX_RANK_FAILED"   # starts the stderr line of a rank that failed


def new_key() -> bytes:
    """A fresh per-launch 32-byte key."""
    return secrets.token_bytes(32)


def private_dir() -> str:
    """A new directory only this user can enter (mkdtemp creates it 0700)."""
    d = tempfile.mkdtemp(prefix="phalanx-")
    os.chmod(d, 0o700)
    return d


def ipc_addresses(directory: str) -> tuple[str, str]:
    return f"ipc://{directory}/requests", f"ipc://{directory}/responses"


def sign(key: bytes, payload: bytes) -> bytes:
    return payload + hmac.digest(key, payload, "sha256")   # the one-shot C path of hmac.new(...).digest()


def verify(key: bytes, frame: bytes) -> bytes | None:
    """The payload if the tag is right, else None (compared in constant time)."""
    if len(frame) < TAG_BYTES:
        return None
    payload, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
    expected = hmac.digest(key, payload, "sha256")
    if not hmac.compare_digest(tag, expected):
        return None
    return payload


class IpcQueue:
    """One end of a PAIR socket carrying signed msgpack messages.

    ``bind=True`` on the user side (the proxy owns the addresses), False on rank 0.
    """

    def __init__(self, address: str, key: bytes, bind: bool, context: zmq.Context | None = None) -> None:
        if len(key) < 32:
            raise ValueError("the IPC key must be at least 32 bytes")
        self.address, self._key = address, key
        self._ctx = context or zmq.Context.instance()
        self.socket = self._ctx.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if bind:
            self.socket.bind(address)
            if address.startswith("ipc://"):
                os.chmod(address[len("ipc://"):], 0o600)
        else:
            self.socket.connect(address)
        self.num_dropped = 0

    def put(self, obj: Any) -> None:
        self.socket.send(sign(self._key, messages.pack(obj)), copy=False)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def get(self, timeout_ms: int | None = None) -> Any | None:
        """The next authentic message, or None if none arrived within ``timeout_ms``.

        Frames with a bad tag are dropped (and counted) and waiting goes on.
        """
        while True:
            if timeout_ms == 0:   # a non-blocking read: one call, not a poll and then a read
                try:
                    frame = self.socket.recv(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    return None
            else:
                if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLIN):
                    return None
                frame = self.socket.recv(copy=True)
            payload = verify(self._key, frame)
            if payload is not None:
                return messages.unpack(payload)
            self.num_dropped += 1
            logger.warning("dropped an IPC frame of %d bytes with a missing or wrong HMAC tag", len(frame))

    def get_nowait(self) -> Any | None:
        return self.get(timeout_ms=0)

    def close(self) -> None:
        self.socket.close(linger=0)
