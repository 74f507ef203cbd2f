"""``vllm bench serve`` command lines: what kvd-loadgen takes, and what it refuses by name.

A command line copied from vLLM's documentation runs unchanged apart from the
model and URL.  vLLM's parser also accepts ``--flag_name`` for
``--flag-name``; ``normalize_argv`` does the same.  A vLLM flag that
kvd-loadgen does not implement is refused with its name and the reason
(``refusal``), never parsed and dropped: each would change what is measured.

``--backend`` names the request shape: ``openai`` and ``vllm`` send
completions requests, ``openai-chat`` chat requests.  ``--endpoint`` is the
path they go to; either one alone decides the other, and a pair that
disagrees is an error (vLLM's own check).
"""

from __future__ import annotations

from typing import Sequence

BACKENDS = ("openai", "openai-chat", "vllm")
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

# vLLM flag -> why kvd-loadgen refuses it.
UNSUPPORTED = {
    "--use-beam-search": "kvd has no beam search",
    "--tokenizer-mode": "kvd-loadgen loads the served model's own tokenizer (pass --tokenizer SPEC)",
    "--trust-remote-code": "kvd-loadgen runs no tokenizer code from a model repository",
    "--skip-tokenizer-init": "lengths are measured with the model's tokenizer",
    "--num-warmups": "warm-up requests are not implemented",
    "--profile": "kvd has no /start_profile endpoint",
    "--append-result": "each run writes its own result file (kvd-loadgen compare/table read several)",
    "--metadata": "run metadata is not implemented; the result file records the machine and git commit",
    "--self-timed": "timed traces are not implemented",
    "--request-id-prefix": "kvd assigns request ids itself",
    "--served-model-name": "pass the served name as --model and the tokenizer as --tokenizer",
    "--lora-modules": "kvd serves no LoRA adapters",
    "--lora-assignment": "kvd serves no LoRA adapters",
    "--ramp-up-strategy": "request-rate ramp-up is not implemented",
    "--ramp-up-start-rps": "request-rate ramp-up is not implemented",
    "--ramp-up-end-rps": "request-rate ramp-up is not implemented",
    "--ready-check-timeout-sec": "the run starts with GET /v1/models and fails at once if the server is down",
    "--chat-template-kwargs": "chat template arguments are not implemented",
    "--insecure": "TLS verification cannot be switched off",
    "--plot-timeline": "use `kvd-loadgen plot RESULT.json` (results saved with --save-detailed)",
    "--timeline-itl-thresholds": "use `kvd-loadgen plot RESULT.json`",
    "--plot-dataset-stats": "use `kvd-loadgen plot RESULT.json`",
    "--probe-request-rate": "probe requests are not implemented",
    "--no-stream": "Hugging Face hub datasets are not read (no downloads)",
    "--no-oversample": "a file with fewer prompts than --num-prompts is always cycled",
    "--enable-multimodal-chat": "kvd serves text models only",
    "--random-batch-size": "embedding batches: kvd serves no embeddings",
    "--no-reranker": "kvd serves no rerankers",
    "--common-prefix-len": "use --random-prefix-len",
    "--endpoint-type": "use --backend (the flag's current spelling)",
    "--bfcl-categories": "Hugging Face hub datasets are not read (no downloads)",
    "--custom-ensure-client-side-data": "kvd serves text models only",
}
# Flag families: every flag starting with one of these is refused.
UNSUPPORTED_PREFIXES = {
    "--random-mm-": "kvd serves text models only",
    "--hf-": "Hugging Face hub datasets are not read (no downloads)",
    "--blazedit-": "Hugging Face hub datasets are not read (no downloads)",
    "--spec-bench-": "the spec_bench dataset is not implemented",
    "--speed-bench-": "the speed_bench dataset is not implemented",
    "--txt-slices-": "the txt-slices dataset is not implemented",
    "--timed-trace-": "timed traces are not implemented",
}
# vLLM dataset names kvd-loadgen does not build.
UNSUPPORTED_DATASETS = {
    "burstgpt": "not implemented",
    "hf": "Hugging Face hub datasets are not read (no downloads)",
    "random-mm": "kvd serves text models only",
    "random-rerank": "kvd serves no rerankers",
    "spec_bench": "not implemented",
    "speed_bench": "not implemented",
    "txt-slices": "not implemented",
    "custom_audio": "kvd serves text models only",
    "custom_image": "kvd serves text models only",
    "timed_trace": "not implemented",
}


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """``--flag_name[=value]`` -> ``--flag-name[=value]`` (vLLM's parser does the same);
    values and everything after ``--`` are left alone."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            out.append(token)
            out.extend(tokens)
            break
        if token.startswith("--"):
            name, sep, value = token.partition("=")
            token = name.replace("_", "-") + sep + value
        out.append(token)
    return out


def refusal(argv: Sequence[str]) -> str | None:
    """The one-line reason the first unsupported vLLM flag in ``argv`` is refused, or None."""
    for token in argv:
        if token == "--":
            return None
        if not token.startswith("--"):
            continue
        name = token.partition("=")[0]
        why = UNSUPPORTED.get(name) or next(
            (why for prefix, why in UNSUPPORTED_PREFIXES.items() if name.startswith(prefix)), None)
        if why:
            return f"{name} is a vllm bench serve flag kvd-loadgen does not support: {why}"
    return None


def dataset_refusal(name: str) -> str | None:
    """Why the vLLM dataset ``name`` is refused, or None for a name that is not vLLM's."""
    why = UNSUPPORTED_DATASETS.get(name)
    return f"--dataset-name {name} is a vllm bench serve dataset kvd-loadgen does not support: {why}" \
        if why else None


def resolve_backend(backend: str | None, endpoint: str | None) -> tuple[str, str]:
    """``(backend, endpoint)`` with the missing one derived from the other.

    Raises ValueError with a one-line reason when the pair disagrees or the
    endpoint is not a completions path.
    """
    if endpoint is not None and not endpoint.startswith("/"):
        raise ValueError(f"--endpoint must be a path starting with /, got {endpoint!r}")
    if backend is None:
        backend = "openai-chat" if endpoint and endpoint.endswith("chat/completions") else "openai"
    if endpoint is None:
        endpoint = CHAT_PATH if backend == "openai-chat" else COMPLETIONS_PATH
    if backend == "openai-chat" and not endpoint.endswith("chat/completions"):
        raise ValueError(f"--backend openai-chat sends chat requests; --endpoint must end with "
                         f"chat/completions, got {endpoint}")
    if backend != "openai-chat" and (endpoint.endswith("chat/completions")
                                     or not endpoint.endswith("completions")):
        raise ValueError(f"--backend {backend} sends completions requests; --endpoint must end with "
                         f"/completions (and not chat/completions: use --backend openai-chat), "
                         f"got {endpoint}")
    return backend, endpoint
