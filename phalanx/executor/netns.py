"""``python -m phalanx.executor.netns -- <command>``: run a one-host MPI job in its own network
namespace, so nothing it opens can be reached from another machine.

Open MPI's launcher (prterun; orterun in Open MPI 4) binds its out-of-band TCP listener to every
interface, and none of its options narrow the bind (``oob_tcp_if_include=lo`` makes it abort:
it drops loopback when another interface exists). A job on one host needs no network at all:
its ranks talk through shared memory, NCCL and ``ipc://`` sockets in the proxy's private
directory, which work across network namespaces. So the launcher starts in a fresh namespace
whose only interface is loopback, and the command is exec'd there (same pid).

Creating a network namespace needs CAP_SYS_ADMIN (root, or a user namespace where the kernel
allows one). Where neither works the command runs in the host's namespace and a line starting
with ``NETNS_FALLBACK`` on stderr says so; the proxy logs it as a warning. A multi-host job
cannot use this: its daemons must reach each other (see README, "Processes").
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
FALLBACK_MARKER = "NETNS_FALLBACK"


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def _map_to_self(uid: int, gid: int) -> None:
    """In a new user namespace: stay the same user (needed before anything else may happen)."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def enter_private_network() -> str | None:
    """Move this process into a new network namespace with loopback up. Returns None on
    success, else why it could not be done (the process is then unchanged)."""
    try:
        _unshare(CLONE_NEWNET)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EACCES):
            return f"unshare(CLONE_NEWNET): {e.strerror}"
        uid, gid = os.getuid(), os.getgid()
        try:   # unprivileged: a user namespace owning the network namespace
            _unshare(CLONE_NEWUSER | CLONE_NEWNET)
            _map_to_self(uid, gid)
        except OSError as e2:
            return f"unshare(CLONE_NEWNET): {e.strerror}; with a user namespace: {e2.strerror}"
    try:
        _loopback_up()
    except OSError as e:
        return f"bringing up loopback in the new namespace: {e.strerror}"
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m phalanx.executor.netns -- <command> [args...]", file=sys.stderr)
        return 2
    why = enter_private_network()
    if why is not None:
        print(f"{FALLBACK_MARKER}: the MPI launcher runs in the host network namespace and listens on every "
              f"interface ({why})", file=sys.stderr, flush=True)
    os.execvp(argv[0], argv)
    return 127   # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
