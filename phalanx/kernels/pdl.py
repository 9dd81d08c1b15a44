"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
running, once every program of that kernel has said so. Each of our kernels that takes a ``PDL``
flag therefore begins with ``release(PDL)``: it tells the next kernel it may be scheduled
(``gdc_launch_dependents``); then ``wait(PDL)`` blocks until the previous kernel has finished and
its writes are visible (``gdc_wait``). ``prologue(PDL)`` is the two together. What it saves is the
launch gap between the dozens of short kernels of a decode step. Kernels without the flag
(cuBLAS, torch ops) wait for their predecessor as usual, and a PDL kernel after one of them simply
starts when it ends.

Between ``release`` and ``wait`` a kernel may read only what no kernel of the current chain of
PDL launches writes: weights and constant tables, and the step's metadata (positions, slots,
sequence lengths, block tables), which are copied in before the forward begins. A chain can run
ahead by more than one kernel (each releases at its start), so nothing a neighbour produces —
activations, the KV pool, split-K counters — may be touched before the wait.

Off on CPU tensors (the interpreter knows no grid dependencies), before compute capability 9.0,
on Triton builds without the intrinsics, and with ``PHALANX_PDL=0``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL stays off and the prologue compiles to nothing
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def release(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def prologue(PDL: tl.constexpr):
    release(PDL)
    wait(PDL)


@functools.cache
def _supported(device_index: int) -> bool:
    if gdc_wait is None or os.environ.get("PHALANX_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL."""
    return t.is_cuda and _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch(t: torch.Tensor, on: bool | None = None) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL flag and the launch attribute."""
    on = enabled(t) if on is None else (on and enabled(t))
    return {"PDL": on, "launch_pdl": on}
