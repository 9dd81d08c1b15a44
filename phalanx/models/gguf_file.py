"""A small GGUF reader: metadata and tensor locations in milliseconds.

The ``gguf`` package's reader builds a numpy view per vocabulary string (seconds for a 49k
vocabulary); this one walks the header with ``struct`` and skips arrays it is not asked for.
Tensor bytes are memory-mapped and dequantized by the ``gguf`` package's per-type block functions
(``GGUFFile.dequantize``).

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, KV count, KV pairs, tensor
infos (name, dims, type, offset), padding to ``general.alignment``, tensor data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# arrays longer than this are skipped unless asked for by name (vocabularies, merges)
SMALL_ARRAY = 256


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]        # GGUF order: fastest-varying first
    ggml_type: int
    offset: int                  # absolute byte offset in the file


class GGUFFile:
    def __init__(self, path: str, keep_arrays: tuple[str, ...] = ()) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        self.tensors: list[TensorInfo] = []
        self._parse(keep_arrays)

    # -- parsing ------------------------------------------------------------------------------------
    def _read(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self._mm, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._read("<Q")
        s = self._mm[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _skip_string(self) -> None:
        self._pos += 8 + struct.unpack_from("<Q", self._mm, self._pos)[0]

    def _value(self, vtype: int, keep: bool, key: str = "") -> Any:
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype])
        if vtype == STRING:
            return self._string()
        if vtype != ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        itype, count = self._read("<I"), self._read("<Q")
        self.array_lengths[key] = count
        if not keep and count > SMALL_ARRAY:
            if itype == STRING:
                for _ in range(count):
                    self._skip_string()
            elif itype in _SCALARS:
                self._pos += count * struct.calcsize(_SCALARS[itype])
            else:
                for _ in range(count):
                    self._value(itype, False)
            return None
        if itype in _SCALARS and itype != 7:
            fmt = _SCALARS[itype]
            out = list(struct.unpack_from(f"<{count}{fmt[1]}", self._mm, self._pos))
            self._pos += count * struct.calcsize(fmt)
            return out
        return [self._value(itype, keep) for _ in range(count)]

    def _parse(self, keep_arrays: tuple[str, ...]) -> None:
        if self._mm[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file")
        self._pos = 4
        version = self._read("<I")
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        for _ in range(n_kv):
            key = self._string()
            vtype = self._read("<I")
            self.metadata[key] = self._value(vtype, key in keep_arrays, key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            dims = tuple(self._read("<Q") for _ in range(n_dims))
            infos.append((name, dims, self._read("<I"), self._read("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [TensorInfo(n, d, t, start + o) for n, d, t, o in infos]

    # -- tensors ------------------------------------------------------------------------------------
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes shaped as ``gguf.quants.dequantize`` expects them."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        qtype = GGMLQuantizationType(info.ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(info.dims))
        nbytes = n // block * type_size
        buf = np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=info.offset)
        rows = tuple(reversed(info.dims[1:]))
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                     GGMLQuantizationType.BF16: np.uint16}[qtype]
            return buf.view(dtype).reshape(rows + (info.dims[0],))
        return buf.reshape(rows + (info.dims[0] // block * type_size,))

    def dequantize(self, info: TensorInfo) -> np.ndarray:
        """The tensor in float32, as ``gguf.quants.dequantize`` gives it. gguf's own call walks
        the rows 16 at a time (~2 s for a 135M model of Q4_1); its per-type block function is
        called here on many blocks at once, which computes the same elementwise values."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = self.raw(info)
        kind = getattr(quants, qtype.name, None) if qtype.name in _BLOCKWISE else None
        if kind is None:
            return quants.dequantize(raw, qtype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        blocks = raw.reshape(-1, type_size)
        out = np.empty((blocks.shape[0], block), dtype=np.float32)
        step = max(1, _VALUES_AT_ONCE // block)
        for i in range(0, blocks.shape[0], step):
            out[i:i + step] = kind.dequantize_blocks(blocks[i:i + step]).reshape(-1, block)
        return out.reshape(raw.shape[:-1] + (raw.shape[-1] // type_size * block,))


# the types whose block function needs no table set up first (the i-quants' grids do)
_BLOCKWISE = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
_VALUES_AT_ONCE = 1 << 23     # values a call (blocks of 32 or 256): bounded temporaries
