"""CUTLASS's GEMMs for Hopper: a choice beside cuBLAS(Lt) for the many-row products.

``cutlass/gemm.cu`` is one CUTLASS 3 GEMM with a warp-specialized TMA mainloop, in two forms:
FP8 (e4m3 × e4m3 → bf16, fast FP8 accumulation) whose epilogue applies a scale per activation
row and per weight row — the product ``fp8.linear`` hands to ``torch._scaled_mm`` — and bf16
(bf16 × bf16 → bf16, float32 accumulation), the product ``F.linear`` hands to cuBLAS. Each
``Tile`` (the element type, the CTA tile, the cluster, ping-pong or cooperative warp groups) is
its own shared library, built with nvcc against the CUTLASS headers of the ``nvidia-cutlass``
package (``cutlass_library`` holds them; nothing of its Python is imported) and kept on disk under
``PHALANX_CACHE_DIR`` (default ``~/.cache/phalanx``), keyed by the source, the tile, the flags and
the compiler. The tiles of the weights' type are built once per machine, in parallel, at the engine's
start-up where the tuner times them (kernels/gemv_tuner.py ``tune_many``); later starts load
them. A tile that fails to build or load is left out (logged), and cuBLAS(Lt) is always a
candidate.

Available where a GPU of compute capability 9.0 (the ``sm_90a`` features: TMA, warp-group MMA)
runs, ``nvcc`` and the package are installed: ``available``. Elsewhere the tuner keeps cuBLAS(Lt).
This module imports no Triton and loads nothing at import.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

SOURCE = Path(__file__).with_name("cutlass") / "gemm.cu"
ARCH = "sm_90a"
CAPABILITY = (9, 0)
logger = logging.getLogger("phalanx")
FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", f"-arch={ARCH}", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
         "-shared", "-cudart", "static")


class Tile(NamedTuple):
    """One CUTLASS configuration: the CTA tile (M, N, K), the thread-block cluster (M, N), the
    mainloop: two warp groups taking turns on separate output tiles (ping-pong) or sharing one
    (cooperative, M ≥ 128); and the operands' type (``"fp8"`` with its scales, or ``"bf16"``)."""

    m: int
    n: int
    k: int
    cluster_m: int
    cluster_n: int
    pingpong: bool
    dtype: str = "fp8"

    @property
    def name(self) -> str:
        return (f"{self.dtype}_t{self.m}x{self.n}x{self.k}_c{self.cluster_m}x{self.cluster_n}_"
                f"{'pingpong' if self.pingpong else 'coop'}")

    def defines(self) -> list[str]:
        return [f"-DPHALANX_NAME={self.name}", f"-DPHALANX_BF16={int(self.dtype == 'bf16')}",
                f"-DPHALANX_TILE_M={self.m}", f"-DPHALANX_TILE_N={self.n}",
                f"-DPHALANX_TILE_K={self.k}", f"-DPHALANX_CLUSTER_M={self.cluster_m}",
                f"-DPHALANX_CLUSTER_N={self.cluster_n}", f"-DPHALANX_PINGPONG={int(self.pingpong)}"]


# The FP8 candidates the tuner times against cuBLASLt (K tiles of 128 bytes: one TMA swizzle atom):
# each beat cuBLASLt somewhere among Llama-3.1-8B's projections at 128–8,192 rows on an H200
# (tools/bench_gemm.py --forms fp8_fast cutlass, docs/results/gpu23_gemm_cutlass.txt), where
# (128, 128) in clusters of 2 and (256, 128) cooperative never did and are not built.
TILES = (
    Tile(64, 128, 128, 1, 1, True),      # 128–256 rows: o and down 1.4–1.5x, q/k/v at 128 1.3x
    Tile(128, 128, 128, 1, 1, True),
    Tile(128, 256, 128, 1, 1, False),
    Tile(128, 256, 128, 2, 1, False),    # down (K = 14,336) from 2,048 rows
)
# The bf16 candidates the tuner times against cuBLAS (K tiles of 64 elements: 128 bytes). Where
# each won a bucket of the Llama-3.1-8B shapes (docs/gpu_notes.md, twenty-seventh round);
# (256, 128) cooperative never did and is not built.
TILES_BF16 = (
    Tile(64, 128, 64, 1, 1, True, "bf16"),       # o and down at 256 rows
    Tile(128, 128, 64, 1, 1, True, "bf16"),      # gate ‖ up at 512, o at 8,192, the output layer at 1,024
    Tile(128, 256, 64, 1, 1, False, "bf16"),     # q/k/v at 2,048
    Tile(128, 256, 64, 2, 1, False, "bf16"),     # gate ‖ up at 4,096, the output layer at 2,048-4,096
)


def headers() -> Path | None:
    """The CUTLASS headers shipped in the ``nvidia-cutlass`` package, or None."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "source"
    return root if (root / "include" / "cutlass" / "cutlass.h").is_file() else None


def nvcc() -> str | None:
    """The CUDA compiler: on PATH, else under $CUDA_HOME."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home, "bin", "nvcc") if home else None
    return str(candidate) if candidate and candidate.is_file() else None


def why_unavailable(device: torch.device) -> str | None:
    """None where the CUTLASS GEMMs can be built and run on ``device``; else the reason."""
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) != CAPABILITY:
        return f"needs compute capability {CAPABILITY[0]}.{CAPABILITY[1]} ({ARCH})"
    if not SOURCE.is_file():
        return f"{SOURCE.name} is not installed beside {Path(__file__).name}"
    if headers() is None:
        return "the nvidia-cutlass package is not installed"
    if nvcc() is None:
        return "nvcc is not on PATH or under CUDA_HOME"
    return None


def fits(n: int, k: int) -> bool:
    """Whether the GEMMs take a weight [n, k]: whole 16-byte TMA rows of either operand type."""
    return n % 16 == 0 and k % 16 == 0


def available(device: torch.device) -> bool:
    return why_unavailable(device) is None


def cache_dir() -> Path:
    base = os.environ.get("PHALANX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "phalanx")
    return Path(base) / "cutlass"


@functools.cache
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


def _package_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def library_path(tile: Tile) -> Path:
    """Where ``tile``'s library is kept: named by a hash of all that goes into it (the source, the
    tile, the flags, the compiler and the flags it takes from the environment, the CUTLASS
    release)."""
    compiler = nvcc()
    inc = headers()
    if compiler is None or inc is None:
        raise RuntimeError("CUTLASS GEMM: nvcc and the nvidia-cutlass package are needed to build it")
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr(tile).encode(), repr(FLAGS).encode(), _compiler_version(compiler).encode(),
                 os.environ.get("NVCC_PREPEND_FLAGS", "").encode(), os.environ.get("NVCC_APPEND_FLAGS", "").encode(),
                 _package_version().encode(), (inc / "include" / "cutlass" / "version.h").read_bytes()):
        digest.update(part)
    return cache_dir() / f"gemm_{tile.name}_{digest.hexdigest()[:16]}.so"


def build(tile: Tile) -> Path:
    """Compile ``tile``'s library unless it is on disk (~2 min of one core); returns its path.
    Processes that build at once (the ranks of one machine) take a lock per library, so one of
    them compiles and the others find the file; it is written under a temporary name and renamed,
    so that no process ever loads half a file."""
    path = library_path(tile)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():          # built by another process while this one waited
            return path
        inc = headers()
        assert inc is not None
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            cmd = [nvcc() or "nvcc", *FLAGS, f"-I{inc / 'include'}", f"-I{inc / 'tools' / 'util' / 'include'}",
                   *tile.defines(), str(SOURCE), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"CUTLASS GEMM {tile.name}: nvcc failed:\n{done.stderr[-4000:]}")
            os.replace(out, path)
    return path


def load_all(tiles: tuple[Tile, ...] = TILES) -> tuple[Kernel, ...]:
    """Build every tile not yet on disk (as many at once as there are cores) and load each: the
    tiles that built and loaded; each one that did not is logged with the reason."""
    missing = [t.name for t in tiles if not library_path(t).is_file()]
    if missing:
        logger.info("building CUTLASS GEMMs %s with nvcc (once per machine; kept in %s)", missing, cache_dir())
    workers = max(1, min(len(tiles), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        built = list(pool.map(_try_build, tiles))
    return tuple(kernel(t) for t, ok in zip(tiles, built, strict=True) if ok and _try_load(t))


def _try_build(tile: Tile) -> bool:
    try:
        build(tile)
        return True
    except Exception as e:  # noqa: BLE001 - any failure leaves this tile out, logged, and cuBLAS(Lt) in
        logger.warning("CUTLASS GEMM %s not built: %s", tile.name, str(e).splitlines()[0] if str(e) else e)
        return False


def _try_load(tile: Tile) -> bool:
    try:
        kernel(tile)
        return True
    except Exception as e:  # noqa: BLE001 - a library that does not load is left out, logged
        logger.warning("CUTLASS GEMM %s not loaded: %s", tile.name, e)
        return False


class Kernel:
    """One tile's GEMM, loaded: FP8 ``kernel(q_rows, rows_scale, q, scale)``, bf16
    ``kernel(x, None, w, None)`` -> bf16 [M, N]."""

    def __init__(self, tile: Tile, path: Path):
        self.tile = tile
        lib = ctypes.CDLL(str(path))
        self._run = getattr(lib, f"phalanx_gemm_{tile.name}")
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2
        self._workspace = getattr(lib, f"phalanx_gemm_{tile.name}_workspace")
        self._workspace.restype = ctypes.c_size_t
        self._workspace.argtypes = [ctypes.c_int] * 3
        self._dtype = torch.bfloat16 if tile.dtype == "bf16" else torch.float8_e4m3fn

    def __call__(self, a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor,
                 b_scale: torch.Tensor | None) -> torch.Tensor:
        """FP8: a [M, K] e4m3 (rows of x, contiguous), a_scale [M, 1] float32, b [N, K] e4m3 (the
        weight), b_scale [N] float32 -> (a · a_scale) (b · b_scale)ᵀ in bf16 [M, N]. bf16: a [M, K],
        b [N, K], no scales -> a bᵀ in bf16 [M, N]."""
        M, K = a.shape
        N = b.shape[0]
        fp8 = self.tile.dtype == "fp8"
        if not (a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype == self._dtype
                and (not fp8 or (a_scale is not None and b_scale is not None
                                 and a_scale.dtype == b_scale.dtype == torch.float32))):
            raise ValueError(f"CUTLASS GEMM {self.tile.name}: needs contiguous {self._dtype} operands"
                             f"{' and float32 scales' if fp8 else ''}, got {a.dtype} {a.stride()}, {b.dtype} "
                             f"{b.stride()}, scales {None if a_scale is None else a_scale.dtype}")
        y = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
        size = self._workspace(M, N, K)
        ws = torch.empty(size, dtype=torch.uint8, device=a.device) if size else None
        status = self._run(a.data_ptr(), b.data_ptr(), y.data_ptr(),
                           a_scale.data_ptr() if a_scale is not None else None,
                           b_scale.data_ptr() if b_scale is not None else None,
                           M, N, K, ws.data_ptr() if ws is not None else None,
                           torch.cuda.current_stream(a.device).cuda_stream)
        if status:
            raise RuntimeError(f"CUTLASS GEMM {self.tile.name}: status {status} for M={M} N={N} K={K}")
        return y


@functools.cache
def kernel(tile: Tile) -> Kernel:
    """``tile``'s GEMM, loaded once per process from the library ``build`` (or ``load_all``) left
    on disk: binding a plan never compiles."""
    path = library_path(tile)
    if not path.is_file():
        raise RuntimeError(f"CUTLASS GEMM {tile.name}: {path} is not built (cutlass_gemm.build)")
    return Kernel(tile, path)
