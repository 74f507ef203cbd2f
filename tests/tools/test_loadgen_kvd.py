"""kvd-loadgen against a real ``kvd serve --model tiny``: every dataset, both endpoints.

The matrix runs the CLI in-process (``cli.main``: argparse, preflight,
datasets with the real SmolLM2 tokenizer, the run, the JSON file) so the
tokenizer is parsed once; one more run goes through the installed
``kvd-loadgen`` console script in a subprocess.  Responses are 8 tokens with
``--ignore-eos``, so the usage the server reports is known exactly.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.loadgen import cli

REPO = Path(__file__).resolve().parents[2]
OUT_LEN = 8
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]
TEXT = ("The quick brown fox jumps over the lazy dog near the river bank on a sunny day",
        "Explain how a paged KV cache lets a server share prompt prefixes between requests",
        "Write a short poem about the sea and the wind and the stars above the harbour")


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("loadgen-data")
    (d / "prompts.txt").write_text("\n".join(TEXT) + "\n")
    sharegpt = [{"id": str(i), "conversations": [{"from": "human", "value": t},
                                                  {"from": "gpt", "value": t + " indeed"}]}
                for i, t in enumerate(TEXT)]
    (d / "sharegpt.json").write_text(json.dumps(sharegpt))
    (d / "custom.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXT))
    return d


DATASET_ARGS = {
    "random": ["--num-prompts", "6", "--random-input-len", "24", "--random-output-len", str(OUT_LEN),
               "--random-range-ratio", "0.5"],
    "prefix-repetition": ["--num-prompts", "6", "--prefix-repetition-num-prefixes", "2",
                          "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "8",
                          "--prefix-repetition-output-len", str(OUT_LEN)],
    "sessions": ["--num-prompts", "3", "--sessions-num-turns", "3", "--sessions-user-len", "12",
                 "--sessions-output-len", str(OUT_LEN), "--sessions-shared-prefix-len", "16"],
    "sharegpt": ["--num-prompts", "6", "--sharegpt-output-len", str(OUT_LEN)],
    "file": ["--num-prompts", "6", "--file-output-len", str(OUT_LEN)],
    "custom": ["--num-prompts", "4", "--custom-output-len", str(OUT_LEN)],
    "sonnet": ["--num-prompts", "3", "--sonnet-input-len", "200", "--sonnet-prefix-len", "80",
               "--sonnet-output-len", str(OUT_LEN)],
}
EXPECTED_REQUESTS = {"random": 6, "prefix-repetition": 6, "sessions": 9, "sharegpt": 6, "file": 6,
                     "custom": 4, "sonnet": 3}


def check_result(doc: dict, dataset: str, endpoint: str) -> None:
    m, recs = doc["metrics"], doc["requests"]
    n = EXPECTED_REQUESTS[dataset]
    assert doc["errors"] == {}
    assert (m["num_requests"], m["completed"], m["failed"]) == (n, n, 0)
    assert len(recs) == n
    for r in recs:
        assert r["success"] and r["usage_reported"]
        assert 0 < r["ttft"] <= r["e2el"]
        assert r["output_tokens"] == r["expected_output_len"]     # --ignore-eos: exactly max_tokens
        if dataset != "random":                                   # random draws it from the range
            assert r["output_tokens"] == OUT_LEN
        assert 1 <= r["chunks"] <= r["output_tokens"]
        assert len(r["itl"]) == r["chunks"] - 1
        assert r["prompt_tokens"] >= r["prompt_len"]
        if endpoint == "/v1/completions" and dataset in ("random", "prefix-repetition", "file", "custom",
                                                         "sonnet"):
            # the prompt is measured in the model's tokens: the server counts the same
            assert r["prompt_tokens"] == r["prompt_len"]
    assert m["total_output_tokens"] == sum(r["output_tokens"] for r in recs)
    assert m["total_input_tokens"] == sum(r["prompt_tokens"] for r in recs)
    if dataset == "sessions":
        for s in {r["session"] for r in recs}:
            turns = sorted((r for r in recs if r["session"] == s), key=lambda r: r["turn"])
            assert [r["turn"] for r in turns] == [0, 1, 2]
            for prev, nxt in zip(turns, turns[1:]):
                assert nxt["start"] >= prev["start"] + prev["e2el"]
                # the whole history is resent: previous prompt + its answer + the new message
                assert nxt["prompt_tokens"] >= prev["prompt_tokens"] + prev["output_tokens"] + nxt["prompt_len"] - 1


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("dataset", list(DATASET_ARGS))
def test_every_dataset_and_endpoint(kvd_server, data_files, tmp_path, capsys, dataset, endpoint):
    args = ["--base-url", kvd_server, "--endpoint", endpoint, "--model", "tiny", "--dataset-name", dataset,
            *DATASET_ARGS[dataset], "--ignore-eos", "--max-concurrency", "4", "--request-rate", "50",
            "--seed", "1", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json",
            "--disable-tqdm"]
    if dataset == "sharegpt":
        args += ["--dataset-path", str(data_files / "sharegpt.json")]
    if dataset == "file":
        args += ["--dataset-path", str(data_files / "prompts.txt")]
    if dataset == "custom":
        args += ["--dataset-path", str(data_files / "custom.jsonl")]
    rc = cli.main(args)
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Serving Benchmark Result" in out.out
    check_result(json.loads((tmp_path / "r.json").read_text()), dataset, endpoint)


def test_console_script_against_kvd(kvd_server, tmp_path):
    script = Path(sys.executable).parent / "kvd-loadgen"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "tools.loadgen.cli"]
    proc = subprocess.run(cmd + ["--base-url", kvd_server, "--endpoint", "/v1/chat/completions",
                                 *DATASET_ARGS["random"], "--ignore-eos", "--save-detailed",
                                 "--result-dir", str(tmp_path), "--result-filename", "r.json",
                                 "--disable-tqdm"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OPENAI_API_KEY": ""})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"]["model"] == "tiny"             # taken from GET /v1/models
    check_result(doc, "random", "/v1/chat/completions")


def test_save_result_at_rate_inf_through_the_console_script(kvd_server, tmp_path):
    """vLLM's default rate, ``inf``, with the default file name: the run is saved, not lost
    after its table was printed (report.default_filename once crashed on the saved "inf")."""
    script = Path(sys.executable).parent / "kvd-loadgen"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "tools.loadgen.cli"]
    proc = subprocess.run(cmd + ["--base-url", kvd_server, "--dataset-name", "random",
                                 "--num-prompts", "3", "--random-input-len", "16",
                                 "--random-output-len", "4", "--ignore-eos", "--request-rate", "inf",
                                 "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OPENAI_API_KEY": ""})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    files = list(tmp_path.glob("*.json"))
    assert [f.name.split("-")[:4] for f in files] == [["kvd", "loadgen", "random", "infqps"]], files
    doc = json.loads(files[0].read_text())
    assert doc["config"]["request_rate"] == "inf"
    assert (doc["metrics"]["completed"], doc["metrics"]["failed"]) == (3, 0)
    assert f"result written to {files[0]}" in proc.stderr


@pytest.mark.parametrize("spelling, saved, label", [
    ("Inf", "inf", "infqps"), ("infinity", "inf", "infqps"), ("+INFINITY", "inf", "infqps"),
    ("1e400", "inf", "infqps"), ("40", 40, "40qps"), ("12.5", 12.5, "12.5qps"), ("2e1", 20, "20qps")])
def test_save_result_for_every_rate_spelling(kvd_server, tmp_path, capsys, spelling, saved, label):
    """Every spelling vLLM's float --request-rate accepts is saved under the default name."""
    rc = cli.main(["--base-url", kvd_server, "--model", "tiny", "--dataset-name", "random",
                   "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2",
                   "--ignore-eos", "--request-rate", spelling, "--save-result",
                   "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert rc == 0, capsys.readouterr().err
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith(f"kvd-loadgen-random-{label}-tiny-"), path.name
    doc = json.loads(path.read_text())
    assert doc["config"]["request_rate"] == saved
    assert doc["metrics"]["completed"] == 2


def test_tokenizer_resolution(capsys):
    tok, spec = cli.load_tokenizer_for(None, "tiny")
    assert spec == "tiny" and tok.vocab_size == 49152
    tok, spec = cli.load_tokenizer_for(None, "org/unknown-model")     # e.g. a vLLM server's name
    assert spec == "smollm2"
    assert "no tokenizer for model 'org/unknown-model'" in capsys.readouterr().err
    with pytest.raises(cli.UserError, match="cannot load a tokenizer .*'nope'"):
        cli.load_tokenizer_for("nope", "tiny")                         # an explicit spec never falls back
