"""``vllm bench serve`` command lines from vLLM's documentation, run by kvd-loadgen
against a real ``kvd serve --model tiny``; vLLM flags kvd-loadgen lacks refused by name.

Each documented line is kept word for word except the model and the URL
(``--model tiny --base-url URL`` replace vLLM's model, ``--port`` and
``--host``) and the data file; what makes a line too long for a test
(``--num-prompts 100``, 128-token answers) is overridden by flags appended
after it, which argparse lets win, so the documented text itself still parses.
"""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools.loadgen import cli, vllm_flags

REPO = Path(__file__).resolve().parents[2]

# From vLLM's docs/benchmarking/cli.md ("Online Benchmark", "Custom Dataset",
# "Running With Sampling Parameters", "Prefix Repetition Dataset") and the
# random-mm example with its dataset named random.
DOC_LINES = {
    "sharegpt": """--backend vllm --model NousResearch/Hermes-3-Llama-3.1-8B --endpoint /v1/completions
                   --dataset-name sharegpt --dataset-path {sharegpt} --num-prompts 10""",
    "custom": """--port 9001 --save-result --save-detailed --backend vllm
                 --model meta-llama/Llama-3.1-8B-Instruct --endpoint /v1/completions --dataset-name custom
                 --dataset-path {custom} --skip-chat-template --num-prompts 80 --max-concurrency 1
                 --temperature=0.3 --top-p=0.75 --result-dir "./log/" """,
    "sampling": """--backend vllm --model NousResearch/Hermes-3-Llama-3.1-8B --endpoint /v1/completions
                   --dataset-name sharegpt --dataset-path {sharegpt} --top-k 10 --top-p 0.9
                   --temperature 0.5 --num-prompts 10""",
    "prefix_repetition": """--backend openai --model meta-llama/Llama-2-7b-chat-hf
                            --dataset-name prefix_repetition --num-prompts 100
                            --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 128
                            --prefix-repetition-num-prefixes 5 --prefix-repetition-output-len 128""",
    "random": """--backend openai-chat --model Qwen/Qwen2.5-VL-3B-Instruct --endpoint /v1/chat/completions
                 --dataset-name random --num-prompts 100 --max-concurrency 10 --random-prefix-len 25
                 --random-input-len 300 --random-output-len 40 --random-range-ratio 0.2
                 --request-rate inf --ignore-eos --seed 42""",
    "sonnet": """--backend openai-chat --model NousResearch/Hermes-3-Llama-3.1-8B
                 --endpoint /v1/chat/completions --dataset-name sonnet --num-prompts 10""",
}
# Test-sized overrides, appended after the documented line.
OVERRIDES = {
    "sharegpt": [],
    "custom": ["--num-prompts", "4", "--custom-output-len", "6"],
    "sampling": ["--sharegpt-output-len", "6"],
    "prefix_repetition": ["--num-prompts", "10", "--prefix-repetition-output-len", "4"],
    "random": ["--num-prompts", "10", "--random-output-len", "6"],
    "sonnet": ["--num-prompts", "4", "--sonnet-output-len", "6"],
}
EXPECTED = {"sharegpt": 10, "custom": 4, "sampling": 10, "prefix_repetition": 10, "random": 10, "sonnet": 4}
PROMPTS = ["What is the capital of India?", "What is the capital of Iran?", "What is the capital of China?"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-data")
    sharegpt = [{"id": str(i), "conversations": [{"from": "human", "value": p},
                                                  {"from": "gpt", "value": f"The capital is city number {i}."}]}
                for i, p in enumerate(PROMPTS)]
    (d / "sharegpt.json").write_text(json.dumps(sharegpt))
    (d / "data.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return {"sharegpt": str(d / "sharegpt.json"), "custom": str(d / "data.jsonl")}


def doc_argv(name: str, data: dict, url: str, result_dir: Path) -> list[str]:
    argv = shlex.split(DOC_LINES[name].format(**data))
    for flag in ("--model", "--port", "--result-dir"):      # the model and URL are ours
        if flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
    return argv + OVERRIDES[name] + ["--model", "tiny", "--base-url", url, "--result-dir", str(result_dir),
                                     "--result-filename", "r.json", "--save-detailed", "--disable-tqdm"]


@pytest.mark.parametrize("name", list(DOC_LINES))
def test_vllm_doc_command_lines_run(kvd_server, data, tmp_path, capsys, name):
    rc = cli.main(doc_argv(name, data, kvd_server, tmp_path))
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Serving Benchmark Result" in out.out and "Mean TTFT (ms):" in out.out
    doc = json.loads((tmp_path / "r.json").read_text())
    m, c = doc["metrics"], doc["config"]
    n = EXPECTED[name]
    assert (m["completed"], m["failed"]) == (n, 0), doc["errors"]
    for key in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert key in m, key                                     # vLLM's result keys
    chat = name in ("random", "sonnet")
    assert c["backend"] == ("openai-chat" if chat else "openai" if name == "prefix_repetition" else "vllm")
    assert c["endpoint"] == ("/v1/chat/completions" if chat else "/v1/completions")
    for r in doc["requests"]:
        assert r["success"] and r["usage_reported"]
        assert 1 <= r["output_tokens"] <= r["expected_output_len"]
        if not chat:          # completions: the server counts the prompt as the dataset measured it
            assert r["prompt_tokens"] == r["prompt_len"]
    if name == "random":      # vLLM's rule: random runs ignore EOS, so every answer is full length
        assert c["ignore_eos"] and all(r["output_tokens"] == r["expected_output_len"] for r in doc["requests"])
        assert {r["prompt_len"] for r in doc["requests"]} <= set(range(25 + 240, 25 + 361))
    if name == "prefix_repetition":      # 512 + 128 tokens, give or take a merge at the seam
        assert all(630 <= r["prompt_len"] <= 650 for r in doc["requests"])
    if name == "sampling":
        assert (c["temperature"], c["top_p"], c["top_k"]) == (0.5, 0.9, 10)
    if name == "custom":
        assert (c["temperature"], c["top_p"], c["max_concurrency"]) == (0.3, 0.75, 1)


def test_label_percentiles_and_underscore_spellings(kvd_server, tmp_path, capsys):
    rc = cli.main(["--base-url", kvd_server, "--model", "tiny", "--dataset_name", "random",
                   "--num_prompts", "3", "--input-len", "12", "--output-len", "3", "--label", "kvd-vs-vllm",
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99.9",
                   "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--disable-tqdm"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("kvd-vs-vllm-random-infqps-tiny-")
    doc = json.loads(path.read_text())
    m = doc["metrics"]
    # the server may carry several tokens in one event (a reader slower than
    # the engine), so a 3-token answer can arrive as one chunk with no gap:
    # ITL then has no sample, and its percentiles are None, as vLLM's are
    gaps = sorted(g * 1e3 for r in doc["requests"] for g in r["itl"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in ("50", "90", "99.9"):
            if metric == "itl" and not gaps:
                assert m[f"p{p}_itl_ms"] is None
            else:
                assert m[f"p{p}_{metric}_ms"] is not None
    if gaps:
        assert m["p99.9_itl_ms"] == pytest.approx(float(np.percentile(gaps, 99.9)))
    assert "P99.9 E2EL (ms):" in out.out and "P50 TPOT (ms):" in out.out
    assert m["total_output_tokens"] == 9 and m["total_input_tokens"] == 36   # --input-len/--output-len


def test_extra_body_is_sent_and_a_field_kvd_refuses_fails_loudly(kvd_server, tmp_path, capsys):
    """--extra-body reaches the server: a field it refuses fails every request with its 400."""
    rc = cli.main(["--base-url", kvd_server, "--model", "tiny", "--num-prompts", "2", "--input-len", "8",
                   "--output-len", "2", "--extra-body", '{"best_of": 3}', "--disable-tqdm"])
    out = capsys.readouterr()
    assert rc == 1
    assert "all 2 requests failed" in out.err and "best_of" in out.out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "kvd-loadgen"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "tools.loadgen.cli"]
    return subprocess.run(cmd + list(args), cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, text", [
    (["--use-beam-search"], "--use-beam-search is a vllm bench serve flag kvd-loadgen does not support"),
    (["--hf-split", "train"], "--hf-split is a vllm bench serve flag"),
    (["--random-mm-base-items-per-request", "2"], "--random-mm-base-items-per-request is a vllm"),
    (["--ramp_up_strategy", "linear"], "--ramp-up-strategy is a vllm bench serve flag"),
    (["--num-warmups=2"], "--num-warmups is a vllm bench serve flag"),
    (["--dataset-name", "hf"], "--dataset-name hf is a vllm bench serve dataset kvd-loadgen does not support"),
    (["--dataset-name", "burstgpt"], "--dataset-name burstgpt is a vllm bench serve dataset"),
    (["--backend", "tgi"], "invalid choice: 'tgi'"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai-chat sends chat"),
    (["--backend", "vllm", "--endpoint", "/v1/chat/completions"], "use --backend openai-chat"),
    (["--endpoint", "/v1/embeddings"], "--endpoint must end with /completions"),
    (["--dataset-name", "random", "--dataset-path", "x.json"], "reads no --dataset-path"),
    (["--random-prefix"], "unrecognized arguments: --random-prefix"),      # no abbreviations
    (["--extra-body", "[1]"], "must be a JSON object"),
    (["--header", "nokey"], "is not KEY=VALUE"),
])
def test_unsupported_vllm_flags_are_refused_by_name(args, text, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--base-url", "http://127.0.0.1:9", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.count("\n") == 1 and err.startswith("kvd-loadgen: error:") and text in err, err


def test_refusal_through_the_console_script():
    proc = run_cli("--base-url", "http://127.0.0.1:9", "--lora-modules", "a", "b")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvd-loadgen: error: --lora-modules is a vllm bench serve flag kvd-loadgen does not support: "
        f"{vllm_flags.UNSUPPORTED['--lora-modules']} (see kvd-loadgen --help)"]


def test_argv_normalization_leaves_values_alone():
    assert vllm_flags.normalize_argv(["--dataset_name", "prefix_repetition", "--extra_body={\"a_b\": 1}",
                                      "--", "--x_y"]) == \
        ["--dataset-name", "prefix_repetition", "--extra-body={\"a_b\": 1}", "--", "--x_y"]
