"""The user side of the process boundary and the wire: the executor client (submit, abort,
results), the proxy to an MPI job, the in-process executor, IPC and the message types."""
