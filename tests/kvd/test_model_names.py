"""``--model`` as users type it, and what ``/v1/models`` says about the model.

A short name or a path; an unknown name is refused with the known ones listed
(exit 2, before any port opens). A served GGUF is named by its
``general.name`` and reports its context length, capped by ``--max-model-len``,
as vLLM's ``max_model_len``; requests name it that way.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import gguf
import openai
import pytest

from tools._twoproc import free_port
from tools.random_gguf import write_architecture

from .conftest import ROOT, running_serve


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("command", [["serve"], ["coordinator", "--insecure"]])
def test_unknown_model_name_lists_the_known_ones_and_exits_2(command):
    port = free_port()
    result = run_cli(*command, "--model", "gemma-9000", "--port", str(port))
    assert result.returncode == 2
    *warnings, error = result.stderr.strip().splitlines()
    assert all(w.startswith("insecure: ") for w in warnings), result.stderr     # --insecure's own notice
    assert error == ("kvd: error: unknown model 'gemma-9000'; known: smollm2, gemma3-270m, tiny[:SEED], "
                        "a path to a .gguf file or a Hugging Face model directory")
    assert port_is_free(port)


def test_a_missing_gguf_path_is_refused_the_same_way(tmp_path):
    result = run_cli("serve", "--model", str(tmp_path / "nope.gguf"), "--port", str(free_port()))
    assert result.returncode == 2
    assert "unknown model" in result.stderr and "gemma3-270m" in result.stderr


def test_a_tokenizer_kvd_does_not_build_is_refused_before_any_port(tmp_path):
    path = tmp_path / "unigram.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<pad>", "</s>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    port = free_port()
    result = run_cli("serve", "--model", str(path), "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvd: error: {path}: tokenizer.ggml.model='t5' is not supported; "
        "kvd builds 'gpt2' (byte-level BPE) and 'llama' (SentencePiece-style BPE)"]
    assert port_is_free(port)


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("named") / "random-llama.gguf"
    write_architecture("llama", path)            # general.name "random llama", context_length 2048
    with running_serve("--model", str(path), "--dtype", "float32", "--max-model-len", "4096",
                       "--kv-blocks", "64", "--num-threads", "1") as s:
        yield s


def test_v1_models_reports_the_files_name_and_context_length(gguf_server):
    client = openai.OpenAI(base_url=gguf_server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    models = client.models.list().data
    assert [m.id for m in models] == ["random llama"]
    assert models[0].model_extra["max_model_len"] == 2048      # the file's 2048, under --max-model-len 4096
    reply = client.completions.create(model="random llama", prompt="Hello", max_tokens=2, temperature=0)
    assert reply.model == "random llama" and reply.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError, match="random llama"):
        client.completions.create(model="random-llama", prompt="Hello", max_tokens=1)


def test_v1_models_context_length_capped_by_the_configured_max(tmp_path):
    path = tmp_path / "random-llama.gguf"
    write_architecture("llama", path)
    with running_serve("--model", str(path), "--dtype", "float32", "--max-model-len", "300",
                       "--kv-blocks", "64", "--num-threads", "1", "--nodes", "1") as s:
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        (model,) = client.models.list().data
        assert (model.id, model.model_extra["max_model_len"]) == ("random llama", 300)
