"""The metadata (key/value) section of a GGUF file, read on its own.

``gguf.GGUFReader`` maps every field and every tensor descriptor of the file
into numpy views before it answers anything: 2.1 s for SmolLM2-135M, of
which the tokenizer needs a dozen keys. Every process that serves or
routes (coordinator, each node, the load generator) builds the tokenizer
at start, so that was 2 s per process. This reader walks the key/value
section once (the two 49k-entry string arrays of the vocabulary in about
0.1 s) and stops before the tensor descriptors.

Values come back as Python values, as ``GGUFReader``'s ``contents()`` gives
them: ints, floats, bools, str, and lists of those for arrays. GGUF versions
2 and 3 (little-endian) are read; anything else, a truncated file or an
unknown value type is a ``ValueError`` that names the file.

``read_tensor_infos`` goes one section further, through the tensor
descriptors, and says where each tensor's bytes lie: the weight loader checks
them against the file's size before mapping it, so a truncated file is
refused by naming the first tensor it cuts. ``read_header`` gives both
sections from one pass (the weight loader maps the tensors from it:
engine/model/gguf_tensors.py).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> numpy dtype of one element (little-endian; bool is one byte)
_NUMERIC = {0: np.dtype("u1"), 1: np.dtype("i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
            4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
            10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8")}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


# ggml type id -> (weights per block, bytes per block), for the types kvd loads
# (ggml.h's enum ggml_type; gguf-py's GGML_QUANT_SIZES)
_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34),
               6: (32, 22), 7: (32, 24), 20: (32, 18),                        # Q5_0 Q5_1 IQ4_NL
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),  # Q2_K .. Q5_K
               14: (256, 210), 23: (256, 136)}                                 # Q6_K IQ4_XS
# their names, in the order an error message lists them
TYPE_NAMES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
              20: "IQ4_NL", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 23: "IQ4_XS"}


class _Truncated(Exception):
    pass


@dataclass(frozen=True)
class TensorInfo:
    """One tensor descriptor: ``shape`` as GGUF lists it (ne0, the row length,
    first); ``ggml_type`` the ggml type id; its bytes are ``[offset, offset +
    nbytes)`` of the file, ``nbytes`` None for a type this reader does not size."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int | None


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata key of the GGUF file at ``path`` with its value."""
    return _read(path, _parse)


def read_tensor_infos(path: str | os.PathLike[str]) -> list[TensorInfo]:
    """Every tensor descriptor of the GGUF file at ``path``, in file order.
    Does not check that the bytes are there (compare ``offset + nbytes`` with
    the file's size)."""
    return _read(path, _parse_header)[1]


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[TensorInfo]]:
    """``(read_metadata(path), read_tensor_infos(path))`` from one pass over the file."""
    return _read(path, _parse_header)


def check_tensor_table(path: str | os.PathLike[str], infos: list[TensorInfo] | None = None) -> None:
    """Refuse, before anything is mapped, a tensor of a type kvd does not load (one
    line naming the tensor, its type and the supported ones) or one whose bytes run
    past the end of the file (a truncated file): ``ValueError``. ``infos``: the file's
    descriptors when the caller has read them already (else they are read here).
    Imports no torch."""
    size = os.path.getsize(path)
    for info in read_tensor_infos(path) if infos is None else infos:
        if info.ggml_type not in TYPE_NAMES:
            import gguf                             # only to name the type

            try:
                type_name = gguf.GGMLQuantizationType(info.ggml_type).name
            except ValueError:
                raise ValueError(f"{path}: tensor {info.name} has unknown GGUF type {info.ggml_type}") from None
            raise ValueError(f"{path}: tensor {info.name} has GGUF type {type_name}, "
                             f"which kvd does not load (supported: {', '.join(TYPE_NAMES.values())})")
        if info.offset + info.nbytes > size:
            raise ValueError(f"{path}: truncated: tensor {info.name} ({TYPE_NAMES[info.ggml_type]} "
                             f"{list(info.shape)}) needs bytes up to {info.offset + info.nbytes}, the file has {size}")


def _read(path: str | os.PathLike[str], parse: Any) -> Any:
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path}: not a GGUF file (too short)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                return parse(buf)          # values are copies: nothing keeps the map
            except _Truncated:
                raise ValueError(f"{path}: truncated GGUF header") from None
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: a GGUF string is not UTF-8 ({e.reason})") from None
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            finally:
                buf.release()


def _parse(buf: memoryview) -> dict[str, Any]:
    return _parse_kv(buf)[0]


def _parse_kv(buf: memoryview) -> tuple[dict[str, Any], int]:
    """The key/value section and the offset just past it."""
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    (version,) = _U32.unpack_from(buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    (n_kv,) = _U64.unpack_from(buf, 16)
    out: dict[str, Any] = {}
    off = 24
    for _ in range(n_kv):
        key, off = _string(buf, off)
        vtype, off = _u32(buf, off)
        out[key], off = _value(buf, off, vtype)
    return out, off


def _parse_header(buf: memoryview) -> tuple[dict[str, Any], list[TensorInfo]]:
    meta, off = _parse_kv(buf)
    (n_tensors,) = _U64.unpack_from(buf, 8)
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    raw = []
    for _ in range(n_tensors):
        name, off = _string(buf, off)
        n_dims, off = _u32(buf, off)
        if n_dims > 4:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = []
        for _ in range(n_dims):
            n, off = _u64(buf, off)
            dims.append(n)
        ggml_type, off = _u32(buf, off)
        rel, off = _u64(buf, off)
        raw.append((name, tuple(dims), ggml_type, rel))
    data_start = -(-off // alignment) * alignment
    infos = []
    for name, dims, ggml_type, rel in raw:
        nbytes = None
        if ggml_type in _TYPE_SIZES:
            per_block, block_bytes = _TYPE_SIZES[ggml_type]
            count = 1
            for n in dims:
                count *= n
            if dims and dims[0] % per_block:
                raise ValueError(f"tensor {name}: row length {dims[0]} is not a multiple of {per_block}")
            nbytes = count // per_block * block_bytes
        infos.append(TensorInfo(name, dims, ggml_type, data_start + rel, nbytes))
    return meta, infos


def _u32(buf: memoryview, off: int) -> tuple[int, int]:
    if off + 4 > len(buf):
        raise _Truncated
    return _U32.unpack_from(buf, off)[0], off + 4


def _u64(buf: memoryview, off: int) -> tuple[int, int]:
    if off + 8 > len(buf):
        raise _Truncated
    return _U64.unpack_from(buf, off)[0], off + 8


def _string(buf: memoryview, off: int) -> tuple[str, int]:
    n, off = _u64(buf, off)
    if off + n > len(buf):
        raise _Truncated
    return str(buf[off:off + n], "utf-8"), off + n


def _value(buf: memoryview, off: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(buf, off)
    if vtype == _ARRAY:
        etype, off = _u32(buf, off)
        count, off = _u64(buf, off)
        if etype == _STRING:
            return _strings(buf, off, count)
        if etype in _NUMERIC:
            dt = _NUMERIC[etype]
            end = off + count * dt.itemsize
            if end > len(buf):
                raise _Truncated
            return np.frombuffer(buf, dtype=dt, count=count, offset=off).tolist(), end
        if etype != _ARRAY:
            raise ValueError(f"unknown GGUF array element type {etype}")
        items = []
        for _ in range(count):                     # an array of arrays
            item, off = _value(buf, off, _ARRAY)
            items.append(item)
        return items, off
    dt = _NUMERIC.get(vtype)
    if dt is None:
        raise ValueError(f"unknown GGUF value type {vtype}")
    if off + dt.itemsize > len(buf):
        raise _Truncated
    return np.frombuffer(buf, dtype=dt, count=1, offset=off).item(), off + dt.itemsize


def _strings(buf: memoryview, off: int, count: int) -> tuple[list[str], int]:
    """``count`` GGUF strings from ``off`` (the vocabulary's hot loop)."""
    unpack, end = _U64.unpack_from, len(buf)
    out = []
    append = out.append
    for _ in range(count):
        if off + 8 > end:
            raise _Truncated
        (n,) = unpack(buf, off)
        off += 8
        if off + n > end:
            raise _Truncated
        append(str(buf[off:off + n], "utf-8"))
        off += n
    return out, off
