"""``borrow_kv_blocks`` with a model the paged attention kernel cannot serve is a
configuration error: the node exits with status 2 and one line, whether the
config named the dtype (bfloat16: refused before anything loads) or ``auto``
resolved to it on this CPU (refused once the model shows it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.engine import resolve_dtype


def node(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd.cli", "node", "--name", "n1", "--model", "tiny", "--insecure",
                           "--borrow-kv-blocks", "8", *flags], capture_output=True, text=True, timeout=120)


def test_borrowing_with_bfloat16_named_exits_2():
    out = node("--dtype", "bfloat16")
    assert out.returncode == 2, out
    assert "borrow_kv_blocks needs dtype float32" in out.stderr.strip().splitlines()[-1]


def test_borrowing_with_auto_resolved_to_bfloat16_exits_2():
    import torch

    if resolve_dtype("auto") != torch.bfloat16:
        pytest.skip("dtype auto is float32 on this CPU: borrowing serves it")
    out = node()
    assert out.returncode == 2, out
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvd: error: borrow_kv_blocks needs the paged attention kernel"), last
