"""Moving a trainer's weights into the engine: both ends, described by plain values.

What travels in a control op (msgpack on the wire, JSON over HTTP) is a list of *specs*, one
per tensor: ``{"name", "dtype", "shape"}`` plus, for tensors shared in place, where the bytes
are. No tensor is ever pickled.

- Colocated (the trainer and the engine on the same host): ``share_tensors`` puts the trainer's
  tensors where an engine rank can map them — CUDA tensors by CUDA IPC handles of their storage
  (the bytes never move until the engine copies them into its own weights), CPU tensors by one
  POSIX shared-memory segment. ``open_tensors`` is the engine's end.
- A process group (the trainer on other GPUs, or another process): ``TrainerGroup`` is the
  trainer's end (rank 0 of a group whose other members are the engine ranks, joined by
  ``join_group``); tensors go as flat byte buckets of at most ``bucket_bytes`` each, laid out
  the same way on both ends by ``bucket_layout`` from the specs alone. NCCL on GPUs, gloo on
  CPUs.
- From disk: only a path travels (the engine reads it with its start-up loader).

Names are Hugging Face checkpoint names with full (unsharded) shapes; every engine rank takes
its own shard, the same way as at start-up.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from multiprocessing import shared_memory
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BUCKET_BYTES = 1 << 30
_ALIGN = 64


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot travel as weights; use one of {', '.join(DTYPES)}")


def tensor_spec(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """The spec of one tensor: name, dtype, shape."""
    try:
        dtype = dtype_name(tensor.dtype)
    except ValueError as e:
        raise ValueError(f"tensor {name!r}: {e}") from None
    return {"name": name, "dtype": dtype, "shape": list(tensor.shape)}


def spec_nbytes(spec: dict[str, Any]) -> int:
    n = DTYPES[spec["dtype"]].itemsize
    for d in spec["shape"]:
        n *= int(d)
    return n


# -- colocated: shared in place ----------------------------------------------------------------------
class SharedTensors:
    """Tensors shared for one update: ``specs`` to send; keep this object alive until the
    engine has answered, then ``close`` it (a CPU segment is unlinked then)."""

    def __init__(self, specs: list[dict[str, Any]], keep: list[Any], segment: shared_memory.SharedMemory | None):
        self.specs, self._keep, self._segment = specs, keep, segment

    def close(self) -> None:
        self._keep = []
        if self._segment is not None:
            self._segment.close()
            self._segment.unlink()
            self._segment = None

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def share_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> SharedTensors:
    """Describe ``(name, tensor)`` pairs for ``LLM.update_weights_from_tensors``: CUDA tensors
    by IPC handles (no copy unless a tensor is not contiguous), CPU tensors copied once into a
    shared-memory segment."""
    items = [(name, t.detach()) for name, t in named]
    if not items:
        raise ValueError("named_tensors is empty")
    on_gpu = {t.is_cuda for _, t in items}
    if len(on_gpu) > 1:
        raise ValueError("named_tensors: all on CUDA or all on the CPU, not both")
    if on_gpu.pop():
        return _share_cuda(items)
    return _share_cpu(items)


def _share_cpu(items: list[tuple[str, torch.Tensor]]) -> SharedTensors:
    offsets, total = [], 0
    for _, t in items:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    segment = shared_memory.SharedMemory(create=True, size=max(total, 1))
    buf = torch.frombuffer(segment.buf, dtype=torch.uint8, count=max(total, 1))
    specs = []
    for (name, t), off in zip(items, offsets, strict=True):
        n = t.numel() * t.element_size()
        buf[off:off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        specs.append({**tensor_spec(name, t), "shm": segment.name, "offset": off})
    del buf
    return SharedTensors(specs, [], segment)


def _share_cuda(items: list[tuple[str, torch.Tensor]]) -> SharedTensors:
    keep, specs = [], []
    for name, t in items:
        t = t.contiguous()
        keep.append(t)
        storage = t.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = storage._share_cuda_()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        specs.append({**tensor_spec(name, t), "cuda_ipc": {
            "device_uuid": uuid, "handle": bytes(handle), "storage_bytes": int(size),
            "storage_offset_bytes": int(offset), "ref_counter_handle": bytes(ref_handle),
            "ref_counter_offset": int(ref_offset), "event_handle": bytes(event) if event else b"",
            "event_sync_required": bool(event_sync), "element_offset": t.storage_offset()}})
    return SharedTensors(specs, keep, None)


_IPC_FIELDS = {"device_uuid": str, "handle": bytes, "storage_bytes": int, "storage_offset_bytes": int,
               "ref_counter_handle": bytes, "ref_counter_offset": int, "event_handle": bytes,
               "event_sync_required": bool, "element_offset": int}


def open_tensors(specs: list[dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's end of ``share_tensors``: each spec's tensor, mapped where it lives (read
    it before the next one; a CPU segment is closed at the end). Every location is checked
    before the first tensor is given (ValueError naming the tensor), so that a bad one refuses
    the update before any weight has changed."""
    segments: dict[str, shared_memory.SharedMemory] = {}
    try:
        _check_locations(specs, segments)
        for spec in specs:
            dtype, shape = DTYPES[spec["dtype"]], [int(d) for d in spec["shape"]]
            n = spec_nbytes(spec)
            if "shm" in spec:
                seg = segments[spec["shm"]]
                raw = torch.frombuffer(seg.buf, dtype=torch.uint8, count=n, offset=spec["offset"]) if n else \
                    torch.empty(0, dtype=torch.uint8)
                yield spec["name"], raw.view(dtype).view(shape)
                del raw
            else:
                yield spec["name"], _open_cuda(spec["cuda_ipc"], dtype, shape)
    finally:
        for seg in segments.values():
            seg.close()


def _check_locations(specs: list[dict[str, Any]], segments: dict[str, shared_memory.SharedMemory]) -> None:
    """Each spec's bytes are where it says: a shared-memory segment that exists and holds
    [offset, offset + its size) (opened into ``segments``), or CUDA IPC fields of the right types
    for a GPU of this host."""
    uuids: set[str] | None = None
    for spec in specs:
        name = spec["name"]
        if "shm" in spec:
            shm, off = spec["shm"], spec.get("offset")
            if not isinstance(shm, str) or not isinstance(off, int) or isinstance(off, bool) or off < 0:
                raise ValueError(f"tensor {name!r}: shm must be a segment name and offset an integer >= 0")
            if shm not in segments:
                try:
                    segments[shm] = shared_memory.SharedMemory(name=shm)
                except (OSError, ValueError) as e:
                    raise ValueError(f"tensor {name!r}: shared-memory segment {shm!r} cannot be opened ({e})") from None
            size, n = segments[shm].size, spec_nbytes(spec)
            if off + n > size:
                raise ValueError(f"tensor {name!r}: bytes [{off}, {off + n}) lie outside segment {shm!r} "
                                 f"({size} bytes)")
        elif "cuda_ipc" in spec:
            ipc = spec["cuda_ipc"]
            bad = [k for k, t in _IPC_FIELDS.items() if not isinstance(ipc, dict) or not isinstance(ipc.get(k), t)]
            if bad:
                raise ValueError(f"tensor {name!r}: cuda_ipc needs {', '.join(bad)}")
            if uuids is None:
                uuids = {str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())}
            if ipc["device_uuid"] not in uuids:
                raise ValueError(f"tensor {name!r}: its GPU ({ipc['device_uuid']}) is not one of this host's")
            start = ipc["element_offset"] * DTYPES[spec["dtype"]].itemsize
            if ipc["element_offset"] < 0 or start + spec_nbytes(spec) > ipc["storage_bytes"]:
                raise ValueError(f"tensor {name!r}: bytes [{start}, {start + spec_nbytes(spec)}) lie outside its "
                                 f"storage ({ipc['storage_bytes']} bytes)")
        else:
            raise ValueError(f"tensor {name!r}: no location (shm or cuda_ipc)")


def _open_cuda(ipc: dict[str, Any], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    device = uuids.get(ipc["device_uuid"])
    if device is None:
        raise ValueError(f"the trainer's GPU {ipc['device_uuid']} is not visible to this engine rank")
    storage = torch.UntypedStorage._new_shared_cuda(
        device, ipc["handle"], ipc["storage_bytes"], ipc["storage_offset_bytes"], ipc["ref_counter_handle"],
        ipc["ref_counter_offset"], ipc["event_handle"] or None, ipc["event_sync_required"])
    t = torch.empty(0, dtype=dtype, device=f"cuda:{device}")
    t.set_(storage, int(ipc["element_offset"]), shape, torch.empty(shape, device="meta").stride())
    return t


# -- a process group ---------------------------------------------------------------------------------
def bucket_layout(specs: list[dict[str, Any]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``specs`` per bucket, in order; a bucket holds at most ``bucket_bytes``
    (a tensor larger than that travels alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[int]] = []
    size = 0
    for i, spec in enumerate(specs):
        n = spec_nbytes(spec)
        if not buckets or size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def _store(host: str, port: int, world_size: int, is_master: bool, timeout: float) -> Any:
    import torch.distributed as dist
    return dist.TCPStore(host, port, world_size, is_master, timeout=datetime.timedelta(seconds=timeout))


def _process_group(store: Any, rank: int, world_size: int, backend: str, timeout: float) -> Any:
    import torch.distributed as dist
    prefixed = dist.PrefixStore("phalanx-weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")


class EngineGroup:
    """An engine rank's end of a weight-update group (the trainer is rank 0). Before each
    update the engine's first rank posts in the rendezvous store whether it takes the specs
    ("ok", or why not), and the trainer reads that before it broadcasts anything: a refused
    update fails on both ends at once instead of leaving a broadcast waiting."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                 posts: bool, timeout: float = 600.0) -> None:
        self.posts = posts
        self.store = _store(master_address, master_port, world_size, False, timeout)
        self.group = _process_group(self.store, rank, world_size, backend, timeout)
        self.num_updates = 0

    def answer(self, error: str | None) -> None:
        """Post this update's verdict (called on every rank; the one with ``posts`` writes it)."""
        self.num_updates += 1
        if self.posts:
            self.store.set(f"update/{self.num_updates}", error or "ok")

    def receive(self, specs: list[dict[str, Any]], bucket_bytes: int,
                device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of ``TrainerGroup.send``, bucket by bucket."""
        for bucket in bucket_layout(specs, bucket_bytes):
            flat = torch.empty(sum(spec_nbytes(specs[i]) for i in bucket), dtype=torch.uint8, device=device)
            _broadcast(self.group, flat)
            off = 0
            for i in bucket:
                spec, n = specs[i], spec_nbytes(specs[i])
                shape = [int(d) for d in spec["shape"]]
                yield spec["name"], flat[off:off + n].view(DTYPES[spec["dtype"]]).view(shape)
                off += n


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    import torch.distributed as dist
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class TrainerGroup:
    """The trainer's end of a weight-update group: rank 0, hosting the rendezvous at
    ``master_address:master_port``. The engine joins with ``LLM.init_weights_update_group``
    (called at the same time, e.g. from another thread). ``send`` runs alongside
    ``LLM.update_weights_from_distributed(specs)`` with the same specs and bucket size."""

    def __init__(self, master_address: str, master_port: int, world_size: int, backend: str | None = None,
                 device: torch.device | str | None = None, timeout: float = 600.0) -> None:
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.store = _store(master_address, master_port, world_size, True, timeout)
        self.group = _process_group(self.store, 0, world_size, self.backend, timeout)
        self.num_updates = 0

    def send(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Broadcast the tensors in buckets, once the engine has taken their specs; raises
        ValueError with the engine's reason when it refused them (nothing is sent then)."""
        items = list(named)
        specs = [tensor_spec(name, t) for name, t in items]
        self.num_updates += 1
        verdict = self.store.get(f"update/{self.num_updates}").decode()
        if verdict != "ok":
            raise ValueError(f"the engine refused the update: {verdict}")
        for bucket in bucket_layout(specs, bucket_bytes):
            parts = [items[i][1].detach().to(self.device).contiguous().view(-1).view(torch.uint8) for i in bucket]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0]
            _broadcast(self.group, flat)

    def close(self) -> None:
        self.group = None
        self.store = None
