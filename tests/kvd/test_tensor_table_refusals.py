"""A GGUF whose tensors kvd cannot serve is refused before any port opens: one line
naming the tensor, its type and the supported types (or where a truncated file is cut),
exit status 2."""

from __future__ import annotations

import struct

from engine.model.gguf_meta import TYPE_NAMES, read_tensor_infos
from tools._twoproc import free_port
from tools.random_gguf import write_architecture

from .test_model_names import port_is_free, run_cli

MXFP4 = 39                      # ggml's type id of a type kvd does not load


def retype(path, tensor: str, ggml_type: int) -> None:
    """Rewrite ``tensor``'s type id in its descriptor (name, n_dims, dims, type, offset)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    path.write_bytes(bytes(data))


def test_an_unsupported_tensor_type_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "mx.gguf"
    write_architecture("llama", path, "Q8_0")
    retype(path, "blk.1.attn_v.weight", MXFP4)
    port = free_port()
    result = run_cli("serve", "--model", str(path), "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvd: error: {path}: tensor blk.1.attn_v.weight has GGUF type MXFP4, which kvd does not load "
        f"(supported: {', '.join(TYPE_NAMES.values())})"]
    assert "Q4_K" in result.stderr and "IQ4_XS" in result.stderr
    assert port_is_free(port)


def test_a_truncated_file_names_the_tensor_it_cuts_and_exits_2(tmp_path):
    path = tmp_path / "cut.gguf"
    write_architecture("llama", path, "Q8_0")
    last = read_tensor_infos(path)[-1]
    path.write_bytes(path.read_bytes()[:last.offset + 4])
    port = free_port()
    result = run_cli("serve", "--model", str(path), "--port", str(port))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvd: error: {path}: truncated: tensor {last.name} ")
    assert port_is_free(port)
