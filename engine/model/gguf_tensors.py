"""The tensors of a GGUF file as numpy views of one read-only memory map.

The weight loader needs each tensor's name, GGUF shape, type and bytes. They
come from the descriptors ``gguf_meta.read_header`` parses, not from
``gguf.GGUFReader``, which first builds numpy views of every metadata field:
for a 262,144-token vocabulary (Gemma 3) that is half a minute before the
first tensor, for which the loader needs only the vocabulary's length.

Each view is laid out as ``GGUFReader`` lays out its ``ReaderTensor.data``
(the arrays ``gguf.quants.dequantize`` and kvd's block decoders take)::

    F32, F16     the values, in numpy order: shape reversed(ne) = [.., rows, ne0]
    every other  uint8 bytes, [.., rows, bytes per row]   (rows = ne1 * ne2 ...)

The views alias the file: copy what must outlive the map or be written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from engine.model.gguf_meta import TensorInfo

_F32, _F16 = 0, 1
_VALUE_DTYPES = {_F32: np.dtype("<f4"), _F16: np.dtype("<f2")}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` as GGUF lists it (ne0, the row length, first),
    ``tensor_type`` the ggml type id, ``data`` a read-only view (module docstring)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray


def map_tensors(path: str | os.PathLike[str], infos: list[TensorInfo]) -> list[GGUFTensor]:
    """The tensors ``infos`` describe (``gguf_meta.read_header``, checked by
    ``check_tensor_table``: every type sized, every byte inside the file), in
    their order, over one read-only map of ``path``. ValueError naming the file
    for a tensor name listed twice (as ``GGUFReader`` refuses it)."""
    seen: set[str] = set()
    for info in infos:
        if info.name in seen:
            raise ValueError(f"{path}: tensor {info.name} is listed twice")
        seen.add(info.name)
    if not infos:
        return []
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for info in infos:
        raw = mapped[info.offset:info.offset + info.nbytes]
        numpy_shape = tuple(reversed(info.shape))
        dtype = _VALUE_DTYPES.get(info.ggml_type)
        if dtype is not None:
            data = raw.view(dtype).reshape(numpy_shape)
        else:                                   # whole rows of blocks: [.., rows, bytes per row]
            rows = numpy_shape[:-1]
            data = raw.reshape(*rows, info.nbytes // max(1, int(np.prod(rows, dtype=np.int64))))
        tensors.append(GGUFTensor(info.name, info.shape, info.ggml_type, data))
    return tensors
