"""``mpirun -n N phalanx launch -- <command>``: run a user command against an MPI job.

Rank 0 starts ``<command>`` as a child with every MPI variable removed (a child may not
re-initialise MPI) and with the IPC addresses and a fresh key in its environment; the ``LLM``
inside it finds them and attaches instead of spawning. Every rank then runs the worker. The
exit code is the command's.
"""

from __future__ import annotations

import os
import subprocess
import sys

from phalanx.executor import ipc
from phalanx.executor.proxy import LAUNCH_ENV, MPI_ENV_PREFIXES
from phalanx.pyexecutor.worker import Rank0Link, run_worker


def launch(command: list[str]) -> int:
    if not command:
        print("usage: mpirun -n N phalanx launch -- <command> [args...]", file=sys.stderr)
        return 2
    from phalanx.pyexecutor.dist import Dist
    dist = Dist()
    child = None
    link = None
    directory = ipc.private_dir() if dist.rank == 0 else None
    directory = dist.bcast_bytes(directory.encode() if directory else None).decode()
    if dist.rank == 0:
        key = ipc.new_key()
        req, resp = ipc.ipc_addresses(directory)
        env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)}
        env.update({LAUNCH_ENV: "1", ipc.KEY_ENV: key.hex(), ipc.REQUEST_ADDR_ENV: req, ipc.RESPONSE_ADDR_ENV: resp})
        child = subprocess.Popen(command, env=env)
        os.environ.update({ipc.KEY_ENV: key.hex(), ipc.REQUEST_ADDR_ENV: req, ipc.RESPONSE_ADDR_ENV: resp})
        link = Rank0Link(alive=lambda: child.poll() is None)
    code = run_worker(link, rendezvous_dir=directory)
    if child is None:
        return code
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.terminate()
        return child.wait()
