"""The command line: user errors, the JSON result, plot, compare, fault injection.

Runs go through ``cli.main`` in-process against the fake SSE server with the
fake word tokenizer; error cases run the real console script in a subprocess
to check the exit code and that stderr is one line without a traceback.
"""

import json
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tools._twoproc import free_port
from tools.loadgen import cli
from tools.loadgen.fake_server import FakeOptions, ServerThread, WordTokenizer

REPO = Path(__file__).resolve().parents[2]


def loadgen_command() -> list[str]:
    script = Path(sys.executable).parent / "kvd-loadgen"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tools.loadgen.cli"]


def run_cli_subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(loadgen_command() + list(args), cwd=REPO, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def fake():
    with ServerThread(FakeOptions(ttft_s=0.002, token_s=0.001)) as server:
        yield server


@pytest.fixture
def word_tokenizer(monkeypatch):
    monkeypatch.setattr(cli, "load_tokenizer_for", lambda spec, model: (WordTokenizer(), "words"))


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvd-loadgen: error:") and text in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, code, text", [
    (["--dataset-name", "nope"], 2, "invalid choice: 'nope'"),
    (["--request-rate", "-3"], 2, "must be > 0"),
    (["--request-rate", "fast"], 2, "not a number"),
    (["--num-prompts", "0"], 2, "at least 1"),
    (["--dataset-name", "file", "--dataset-path", "/no/such/prompts.txt"], 2, "dataset file not found"),
    (["--dataset-name", "sharegpt"], 2, "needs --dataset-path"),
    (["--goodput", "ttft:abc"], 2, "bad --goodput item"),
    (["--percentile-metrics", "ttft,latency"], 2, "unknown metric 'latency'"),
    (["--metric-percentiles", "50,101"], 2, "[0, 100]"),
    (["--fail", "n1@5"], 2, "--fail needs --admin-socket"),
    (["--fail", "n1@soon", "--admin-socket", "/tmp/x"], 2, "bad --fail"),
    (["--no-such-flag"], 2, "unrecognized arguments"),
])
def test_bad_arguments_exit_2_with_one_line(args, code, text):
    assert_one_line_error(run_cli_subprocess(*args), code, text)


def test_unreachable_server_exits_1():
    port = free_port()
    proc = run_cli_subprocess("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2")
    assert_one_line_error(proc, 1, f"cannot reach server at http://127.0.0.1:{port}")


def test_missing_admin_socket_exits_before_the_run(tmp_path):
    path = tmp_path / "admin.sock"
    proc = run_cli_subprocess("--base-url", "http://127.0.0.1:9", "--admin-socket", str(path),
                              "--fail", "n1@1")
    assert_one_line_error(proc, 1, f"target has no admin socket at {path}")
    path.touch()                       # a file that is not a listening socket
    proc = run_cli_subprocess("--base-url", "http://127.0.0.1:9", "--admin-socket", str(path),
                              "--fail", "n1@1")
    assert_one_line_error(proc, 1, f"target has no admin socket at {path}")


def test_plot_and_compare_errors(tmp_path):
    assert_one_line_error(run_cli_subprocess("compare", str(tmp_path / "a.json")), 2, "at least two")
    assert_one_line_error(run_cli_subprocess("compare", "/no/a.json", "/no/b.json"), 1, "cannot read")
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": 1}')
    assert_one_line_error(run_cli_subprocess("plot", str(bad)), 1, "not a kvd-loadgen result")


def test_help_lists_vllm_flags():
    proc = run_cli_subprocess("--help")
    assert proc.returncode == 0
    for flag in ("--base-url", "--endpoint", "--dataset-name", "--num-prompts", "--request-rate",
                 "--burstiness", "--max-concurrency", "--goodput", "--save-detailed", "--fail"):
        assert flag in proc.stdout


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_run_writes_result_with_records(fake, word_tokenizer, tmp_path, capsys, endpoint):
    rc, out, err = run_main(
        capsys, "--base-url", fake.url, "--endpoint", endpoint, "--dataset-name", "random",
        "--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "6",
        "--request-rate", "200", "--max-concurrency", "4", "--goodput", "ttft:1000", "tpot:1000",
        "--metric-percentiles", "50,90,99", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm")
    assert rc == 0, err
    assert "Serving Benchmark Result" in out and "Request goodput (req/s):" in out
    assert "P90 E2EL (ms):" in out and "Maximum request concurrency:" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    m = doc["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (12, 0, 72)
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    assert doc["config"]["model"] == "fake" and doc["config"]["request_rate"] == 200
    assert doc["config"]["endpoint"] == endpoint and "api_key" not in doc["config"]
    assert doc["machine"]["cpu_count"] >= 1
    recs = doc["requests"]
    assert len(recs) == 12 and all(r["ttft"] <= r["e2el"] for r in recs)
    assert all(r["output_tokens"] == 6 and len(r["itl"]) == 5 for r in recs)
    assert "text" not in recs[0]                       # completions are never saved


def test_failures_are_reported_not_dropped(fake, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6\nFAIL500\nDROP w7\nEMPTY\n")
    monkeypatch.setattr(cli, "load_tokenizer_for", lambda spec, model: (WordTokenizer(), "words"))
    rc, out, err = run_main(capsys, "--base-url", fake.url, "--dataset-name", "file", "--dataset-path",
                            str(prompts), "--num-prompts", "8", "--file-output-len", "4", "--save-result",
                            "--result-dir", str(tmp_path), "--result-filename", "f.json")
    assert rc == 0
    assert "8/8 [" in err and "failed=4" in err          # the progress bar, on a pipe
    assert "Failed requests:                         4" in out
    assert "Empty responses:                         2" in out
    assert "2 x HTTP 500: scripted failure" in out
    doc = json.loads((tmp_path / "f.json").read_text())
    assert doc["metrics"]["completed"] == 4 and doc["metrics"]["failed"] == 4
    assert doc["errors"]["HTTP 500: scripted failure"] == 2 and sum(doc["errors"].values()) == 4
    assert "requests" not in doc                       # only with --save-detailed


def test_all_failed_exits_1(fake, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text("FAIL500\n")
    monkeypatch.setattr(cli, "load_tokenizer_for", lambda spec, model: (WordTokenizer(), "words"))
    rc, _, err = run_main(capsys, "--base-url", fake.url, "--dataset-name", "file", "--dataset-path",
                          str(prompts), "--num-prompts", "3", "--disable-tqdm")
    assert rc == 1 and "kvd-loadgen: error: all 3 requests failed" in err


def test_plot_and_compare(fake, word_tokenizer, tmp_path, capsys):
    for name, rate in (("a", "inf"), ("b", "100")):
        rc, _, _ = run_main(capsys, "--base-url", fake.url, "--dataset-name", "sessions",
                            "--num-prompts", "4", "--sessions-num-turns", "2", "--sessions-user-len", "5",
                            "--sessions-output-len", "3", "--request-rate", rate, "--save-detailed",
                            "--result-dir", str(tmp_path), "--result-filename", f"{name}.json",
                            "--disable-tqdm")
        assert rc == 0
    rc, out, _ = run_main(capsys, "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert rc == 0
    header, rule, *rows = out.strip().splitlines()
    assert header.split() == ["metric", "a", "b", "b/a"]
    completed = next(r for r in rows if r.startswith("completed "))
    assert completed.split() == ["completed", "8", "8", "1.000"]
    assert any(r.startswith("mean_ttft_ms") for r in rows)
    rc, out, _ = run_main(capsys, "table", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert rc == 0
    head, rule, row_a, row_b = out.strip().splitlines()
    assert head.count("|") == rule.count("|") == row_a.count("|") == row_b.count("|")
    assert "| fake | /v1/completions | sessions | 8 | inf |" in row_a and "| 100 |" in row_b
    rc, out, _ = run_main(capsys, "plot", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                          "-o", str(tmp_path / "plots" / "ab"))
    assert rc == 0
    for suffix in ("cdf", "throughput"):
        png = tmp_path / "plots" / f"ab-{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, _ = run_main(capsys, "--base-url", fake.url, "--num-prompts", "2", "--random-input-len", "3",
                        "--random-output-len", "2", "--save-result", "--result-dir", str(tmp_path),
                        "--result-filename", "plain.json", "--disable-tqdm")
    rc, _, err = run_main(capsys, "plot", str(tmp_path / "plain.json"))
    assert rc == 1 and "--save-detailed" in err


class AdminSocket:
    """A stand-in daemon admin socket: records commands, answers each with ``reply``."""

    def __init__(self, path: Path, reply: dict) -> None:
        self.commands: list[dict] = []
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                line = self.rfile.readline()
                if not line:           # kvd-loadgen's connect-only check before the run
                    return
                outer.commands.append(json.loads(line))
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        self.server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("reply, ok", [({"ok": True}, True), ({"error": "no node n9"}, False)])
def test_fault_injection_through_the_admin_socket(fake, word_tokenizer, tmp_path, capsys, reply, ok):
    sock = tmp_path / "a.sock"
    prompts = tmp_path / "p.txt"
    prompts.write_text("SLOW\n")
    with AdminSocket(sock, reply) as admin:
        rc, out, err = run_main(capsys, "--base-url", fake.url, "--dataset-name", "file",
                                "--dataset-path", str(prompts), "--num-prompts", "4", "--file-output-len", "4",
                                "--max-concurrency", "1", "--admin-socket", str(sock),
                                "--fail", "n1@0.05", "--fail", "n9@0.1:stop", "--fail", "n2@600",
                                "--save-result", "--result-dir", str(tmp_path), "--result-filename", "x.json",
                                "--disable-tqdm")
    assert rc == 0, err
    assert admin.commands == [{"cmd": "fail", "node": "n1", "mode": "exit"},
                              {"cmd": "fail", "node": "n9", "mode": "stop"}]
    faults = json.loads((tmp_path / "x.json").read_text())["faults"]
    assert [(f["node"], f["ok"]) for f in faults] == [("n1", ok), ("n9", ok), ("n2", False)]
    assert faults[0]["sent_s"] >= 0.05 and faults[1]["sent_s"] >= 0.1
    assert faults[2]["sent_s"] is None and faults[2]["error"] == "not sent: the run ended first"
    assert "Faults injected" in out
    if not ok:
        assert faults[0]["error"] == "no node n9"


def test_compare_outputs_request_by_request(fake, word_tokenizer, tmp_path, capsys):
    for name, extra in (("a", "--save-outputs"), ("b", "--save-outputs"), ("c", "--save-detailed")):
        rc, _, _ = run_main(capsys, "--base-url", fake.url, "--dataset-name", "sessions",
                            "--num-prompts", "3", "--sessions-num-turns", "2", "--sessions-user-len", "5",
                            "--sessions-output-len", "3", "--request-rate", "inf", extra,
                            "--result-dir", str(tmp_path), "--result-filename", f"{name}.json", "--disable-tqdm")
        assert rc == 0
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert all(r["text"] for r in json.loads(a.read_text())["requests"])
    rc, out, _ = run_main(capsys, "compare", "--outputs", str(a), str(b))
    assert rc == 0 and out.strip() == "b vs a: 6 identical, 0 different, 0 failed, 0 missing"
    doc = json.loads(b.read_text())
    doc["requests"][3]["text"] += "!"
    key = [doc["requests"][3]["session"], doc["requests"][3]["turn"]]
    b.write_text(json.dumps(doc))
    rc, out, _ = run_main(capsys, "compare", "--outputs", str(a), str(b))
    assert rc == 1 and out.strip() == f"b vs a: 5 identical, 1 different, 0 failed, 0 missing; differing " \
                                      f"(session, turn): [{key}]"
    rc, _, err = run_main(capsys, "compare", "--outputs", str(a), str(tmp_path / "c.json"))
    assert rc == 1 and "--save-outputs" in err


def test_sampling_flags_reach_every_request_body(word_tokenizer, tmp_path, capsys):
    """--temperature, --top-p and --top-k are request fields (top_p and top_k only when given),
    and the result file records them."""
    bodies: list = []
    with ServerThread(FakeOptions(ttft_s=0.001, token_s=0.001, bodies=bodies)) as server:
        common = ("--base-url", server.url, "--dataset-name", "random", "--num-prompts", "3",
                  "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm")
        rc, _, err = run_main(capsys, *common, "--temperature", "0.7", "--top-p", "0.9", "--top-k", "40",
                              "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json")
        assert rc == 0, err
        sent = [b for b in bodies if b["path"] == "/v1/completions"]
        assert len(sent) == 3 and all((b["temperature"], b["top_p"], b["top_k"]) == (0.7, 0.9, 40) for b in sent)
        config = json.loads((tmp_path / "r.json").read_text())["config"]
        assert (config["top_p"], config["top_k"]) == (0.9, 40)
        bodies.clear()
        assert run_main(capsys, *common)[0] == 0
        assert not any("top_p" in b or "top_k" in b for b in bodies)
    for flag in ("--top-p", "--top-k"):
        assert_one_line_error(run_cli_subprocess(flag, "0"), 2, "must be")
