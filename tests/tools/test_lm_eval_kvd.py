"""lm-evaluation-harness against a real ``kvd serve --model tiny``: the repository's
task files (tools/eval/tasks), a generation task through ``local-completions`` and
``local-chat-completions`` and a loglikelihood task through ``local-completions``.

Nothing is downloaded (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE): the data set is a
local JSONL file and the loglikelihood run reads the served model's tokenizer
from a directory ``tools.eval.tokenizer`` writes.  Each answer lm-eval records
is checked against the same request sent with the official ``openai`` client:
the generated text, and each choice's summed logprob from ``echo`` with the
prompt's logprobs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.eval.tokenizer import export

pytestmark = pytest.mark.slow       # lm-eval loads transformers; each run takes half a minute

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tools" / "eval" / "tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SEED = 1234                     # lm-eval's default request seed
GEN = {"max_tokens": 16, "temperature": 0.0, "stop": ["\n", "Question:"], "seed": SEED}


def lm_eval(tmp_path: Path, model: str, model_args: dict, tasks: str, *extra: str) -> dict[str, list[dict]]:
    """Run ``lm_eval`` from the repository root; returns each task's logged samples."""
    out = tmp_path / "out"
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args,
                           "--tasks", tasks, "--include_path", str(TASKS), "--output_path", str(out),
                           "--log_samples", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **OFFLINE, "OPENAI_API_KEY": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = {}
    for task in tasks.split(","):
        (path,) = out.glob(f"*/samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    (results,) = out.glob("*/results_*.json")
    samples["results"] = json.loads(results.read_text())["results"]
    return samples


@pytest.fixture(scope="module")
def client(kvd_server):
    import openai
    with openai.OpenAI(base_url=kvd_server + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_generation_and_loglikelihood_through_local_completions(kvd_server, client, tmp_path):
    tokenizer_dir = export("tiny", tmp_path / "tokenizer")
    got = lm_eval(tmp_path, "local-completions",
                  {"model": "tiny", "base_url": f"{kvd_server}/v1/completions",
                   "tokenizer_backend": "huggingface", "tokenizer": tokenizer_dir, "max_retries": 1},
                  "kvd_qa_gen,kvd_qa_mc")
    assert len(got["kvd_qa_gen"]) == len(got["kvd_qa_mc"]) == 10
    for s in got["kvd_qa_gen"]:
        prompt = s["arguments"]["gen_args_0"]["arg_0"]
        direct = client.completions.create(model="tiny", prompt=prompt, **GEN).choices[0].text
        assert s["resps"] == [[direct]], prompt

    correct = 0
    for s in got["kvd_qa_mc"]:
        sums = []
        for (ll, greedy), arg in zip((r[0] for r in s["resps"]), s["arguments"].values()):
            context, continuation = arg["arg_0"], arg["arg_1"]
            n_ctx = len(client.completions.create(model="tiny", prompt=context, max_tokens=0, echo=True,
                                                  logprobs=1).choices[0].logprobs.tokens)
            lp = client.completions.create(model="tiny", prompt=context + continuation, max_tokens=0,
                                           echo=True, logprobs=1, temperature=0).choices[0].logprobs
            expected = sum(lp.token_logprobs[n_ctx:])
            assert float(ll) == pytest.approx(expected, abs=1e-4), (context, continuation)
            is_greedy = all(t == max(top.values()) for t, top in
                            zip(lp.token_logprobs[n_ctx:], lp.top_logprobs[n_ctx:]))
            assert greedy == str(is_greedy)
            sums.append(expected)
        correct += max(range(len(sums)), key=sums.__getitem__) == s["doc"]["label"]
    assert got["results"]["kvd_qa_mc"]["acc,none"] == pytest.approx(correct / 10)


def test_generation_through_local_chat_completions(kvd_server, client, tmp_path):
    got = lm_eval(tmp_path, "local-chat-completions",
                  {"model": "tiny", "base_url": f"{kvd_server}/v1/chat/completions", "max_retries": 1},
                  "kvd_qa_gen", "--apply_chat_template")
    assert len(got["kvd_qa_gen"]) == 10
    for s in got["kvd_qa_gen"]:
        messages = json.loads(s["arguments"]["gen_args_0"]["arg_0"][0])
        direct = client.chat.completions.create(model="tiny", messages=messages, **GEN)
        assert s["resps"] == [[direct.choices[0].message.content]], messages
    assert "exact_match,strip" in got["results"]["kvd_qa_gen"]
