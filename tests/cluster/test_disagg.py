"""Disaggregated prefill over real daemons: 1P1D and 2P2D, the openai client,
tokens equal to the single-node engine's, and every failure case ending in
time with every block returned on both sides."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time

import pytest

from .conftest import MODEL, SEEDED, Cluster, admin, body_of, reference_tokens, running_cluster

ROLES = {"p1": "prefill", "d1": "decode"}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(n)]


def start(tmp, transport: str, roles: dict[str, str], extra: tuple[str, ...] = (),
          node_extra: tuple[str, ...] = ()) -> Cluster:
    """A cluster of ``roles`` whose every prompt goes to a prefill node (no
    threshold, no queue bound) unless ``extra`` says otherwise."""
    c = Cluster(tmp, transport, extra=("--prefill-queue-factor", "0", *extra))
    for name, role in roles.items():
        c.start_node(name, "--role", role, "--prefill-threshold", "0", "--kv-transfer-timeout", "3",
                     *node_extra)
    c.wait_nodes(sorted(roles))
    return c


def stream(client, ids: list[int], max_tokens: int, sampling: dict | None = None) -> tuple[str, str, object]:
    """A streamed completion of ``ids``: greedy, or ``sampling`` (conftest.SEEDED's fields)."""
    text, finish, usage = [], None, None
    for chunk in client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, stream=True,
                                           stream_options={"include_usage": True}, **body_of(sampling)):
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    return "".join(text), finish, usage


def node_status(c: Cluster, name: str) -> dict:
    return admin(c.node_admin(name), "status")


def wait_idle(c: Cluster, names, timeout: float = 30.0) -> None:
    """Every node's device blocks back to free + cached (nothing request-owned)."""
    deadline = time.monotonic() + timeout
    while True:
        kv = {n: admin(c.node_admin(n), "cache stats")["kv"]["device"] for n in names}
        if all(v["request_owned"] == 0 for v in kv.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still owned: {kv}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    c = start(tmp_path_factory.mktemp("pd"), "zmq+tcp", ROLES)
    yield c
    c.stop()


def test_roles_are_registered_and_shown(pd):
    nodes = {n["name"]: n["role"] for n in admin(pd.admin_socket, "nodes")["nodes"]}
    assert nodes == ROLES
    assert node_status(pd, "p1")["role"] == "prefill"


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_1p1d_tokens_equal_the_single_node_engine(pd, reference_engine, seeded):
    """The prompt computed on p1 and its KV streamed to d1, which decodes: the single-node
    engine's tokens, greedy and seeded (temperature 0.7 to 1.0, top-p and top-k)."""
    prompts = [prompt(i, n) for i, n in enumerate((5, 16, 40, 100, 150))]
    sampling = [SEEDED[i % len(SEEDED)] if seeded else None for i in range(len(prompts))]
    ref = reference_tokens(reference_engine, prompts, 16, [s or {"temperature": 0.0} for s in sampling])
    client = pd.client(timeout=60)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda ps: stream(client, *ps), [(p, 16, s) for p, s in zip(prompts, sampling)]))
    tok = reference_engine.tokenizer
    for (text, finish, usage), r, p in zip(results, ref, prompts):
        assert finish == "length"
        assert text == tok.decode(r)
        assert usage.completion_tokens == 16 and usage.prompt_tokens == len(p)
    st = node_status(pd, "d1")["disaggregation"]["decode"]
    assert st["remote"] >= 5 and st["failed"] == 0
    assert node_status(pd, "p1")["disaggregation"]["prefill"].get("done", 0) >= 5
    wait_idle(pd, ROLES)


def test_seeded_and_adjusted_sampling_across_the_split_equals_the_single_node_engine(pd, reference_engine):
    """Token 0 is drawn on the prefill node, the rest on the decode node: with a seed and
    logit_bias, repetition_penalty and min_p (carried on the wire), the same tokens as
    one engine, greedy and seeded."""
    from engine.request import SamplingParams

    cases = [dict(temperature=0.0, repetition_penalty=1.8, logit_bias={"321": 4.0}),
             dict(temperature=0.1, seed=11, min_p=0.3, repetition_penalty=1.4),
             dict(temperature=1.0, seed=12, top_p=0.9, logit_bias={"77": 100.0})]
    prompts = [prompt(60 + i, n) for i, n in enumerate((20, 40, 70))]
    client = pd.client(timeout=60)
    tok = reference_engine.tokenizer
    for p, kw in zip(prompts, cases):
        sampling = {**kw, "logit_bias": tuple((int(t), b) for t, b in kw.get("logit_bias", {}).items())}
        ref = reference_engine.generate([p], SamplingParams(max_tokens=12, ignore_eos=True, **sampling))[0]
        extra = {k: kw[k] for k in ("repetition_penalty", "min_p") if k in kw}
        out = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=kw["temperature"],
                                        seed=kw.get("seed"), top_p=kw.get("top_p"),
                                        logit_bias=kw.get("logit_bias"), extra_body={"ignore_eos": True, **extra})
        assert out.choices[0].text == tok.decode(ref), kw
    assert tok.decode(ref) == tok.decode([77] * 12)          # the +100 bias held on both sides
    wait_idle(pd, ROLES)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_prefix_hits_on_either_side_keep_the_tokens(pd, reference_engine, seeded):
    client = pd.client(timeout=60)
    system = prompt(77 + 10 * seeded, 96)
    a, b = system + prompt(78, 20), system + prompt(79, 23)
    sampling = SEEDED[2] if seeded else None
    ref = reference_tokens(reference_engine, [a, b], 12, sampling)
    text_a, _, _ = stream(client, a, 12, sampling)
    text_b, _, usage = stream(client, b, 12, sampling)      # both sides hold the system prompt now
    tok = reference_engine.tokenizer
    assert (text_a, text_b) == (tok.decode(ref[0]), tok.decode(ref[1]))
    assert usage.prompt_tokens_details.cached_tokens >= 96    # the prefill node's cache (PD-Caching-2)
    wait_idle(pd, ROLES)


def test_a_finished_turn_returns_its_kv_to_the_prefill_node(pd, reference_engine):
    """PD-Caching-3: once turn 1 finished, d1 pushes the KV of its prompt and
    answer to p1, so turn 2 (turn 1, its answer, new tokens) hits p1's cache
    past the answer; both turns give the single-node engine's tokens."""
    client = pd.client(timeout=60)
    tok = reference_engine.tokenizer
    turn1 = prompt(90, 70)
    answer = reference_tokens(reference_engine, [turn1], 40)[0]
    done = admin(pd.admin_socket, "status")["kv_returns"].get("done", 0)
    text1, _, usage1 = stream(client, turn1, 40)
    assert text1 == tok.decode(answer) and usage1.prompt_tokens_details.cached_tokens < len(turn1)
    deadline = time.monotonic() + 30
    while admin(pd.admin_socket, "status")["kv_returns"].get("done", 0) == done:
        assert time.monotonic() < deadline, admin(pd.admin_socket, "status")["kv_returns"]
        time.sleep(0.1)
    turn2 = turn1 + answer + prompt(91, 20)
    ref2 = reference_tokens(reference_engine, [turn2], 12)[0]
    text2, _, usage2 = stream(client, turn2, 12)
    assert text2 == tok.decode(ref2)
    with_kv = (len(turn1) + len(answer) - 1) // 16 * 16          # the answer's last token has no KV yet
    assert usage2.prompt_tokens_details.cached_tokens == with_kv > len(turn1)
    wait_idle(pd, ROLES)


def test_non_streaming_and_first_token_finish(pd, reference_engine):
    client = pd.client(timeout=60)
    p = prompt(5, 30)
    ref = reference_tokens(reference_engine, [p], 1)[0]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=1, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == reference_engine.tokenizer.decode(ref)
    assert r.choices[0].finish_reason == "length"
    wait_idle(pd, ROLES)


def test_client_that_leaves_aborts_both_legs(pd):
    client = pd.client(timeout=60)
    it = client.completions.create(model=MODEL, prompt=prompt(9, 64), max_tokens=400, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True})
    next(iter(it))
    it.response.close()
    wait_idle(pd, ROLES)
    deadline = time.monotonic() + 10      # the prefill leg may still be committing to d1 when d1 is done
    while (node_status(pd, "d1")["in_flight"] or node_status(pd, "p1")["in_flight"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node_status(pd, "d1")["in_flight"] == 0 == node_status(pd, "p1")["in_flight"]


def test_transfer_past_its_deadline_is_recomputed(pd, reference_engine):
    """KV refused by the decode node (fault injection: its commit too): the
    reservation expires at kv_transfer_timeout (3 s here), its blocks come
    back and the decode node computes the prompt; tokens unchanged."""
    client = pd.client(timeout=60)
    p = prompt(31, 70)
    ref = reference_tokens(reference_engine, [p], 10)[0]
    admin(pd.node_admin("d1"), "fail", mode="drop-transfers")
    try:
        text, finish, _ = stream(client, p, 10)
    finally:
        admin(pd.node_admin("d1"), "fail", mode="resume")
    assert text == reference_engine.tokenizer.decode(ref)
    st = node_status(pd, "d1")["disaggregation"]["decode"]
    assert st["timed_out"] >= 1
    assert node_status(pd, "p1")["disaggregation"]["prefill"].get("failed", 0) >= 1
    wait_idle(pd, ROLES)


def test_kv_load_failure_fail_ends_the_request_with_an_openai_error(pd):
    import openai

    pd.start_node("d2", "--role", "decode", "--prefill-threshold", "0", "--kv-transfer-timeout", "2",
                  "--kv-load-failure", "fail")
    pd.wait_nodes(["d1", "d2", "p1"])
    admin(pd.admin_socket, "drain", node="d1")
    admin(pd.node_admin("d2"), "fail", mode="drop-transfers")
    client = pd.client(timeout=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            client.completions.create(model=MODEL, prompt=prompt(41, 50), max_tokens=5, temperature=0)
        assert time.monotonic() - t0 < 15
        assert "KV did not arrive" in str(err.value)
    finally:
        admin(pd.admin_socket, "undrain", node="d1")
        admin(pd.node_admin("d2"), "fail", mode="resume")
    wait_idle(pd, ["d1", "d2", "p1"])
    pd.nodes.pop("d2").stop()


def test_decode_node_without_free_blocks_computes_the_prompt_itself(pd, reference_engine):
    """d3 has 12 blocks; request A (40 + 140 tokens) decodes there and holds
    3 or more, so B's 150-token prompt (10 blocks) cannot be reserved: d3
    computes B itself (no prefill leg), once A leaves it room. Both get the
    reference tokens, and no block stays owned on either side."""
    pd.wait_gone("d2", 10)
    pd.start_node("d3", "--role", "decode", "--prefill-threshold", "0", "--kv-blocks", "12",
                  "--host-kv-blocks", "0")
    pd.wait_nodes(["d1", "d3", "p1"])
    admin(pd.admin_socket, "drain", node="d1")
    a, b = prompt(61, 40), prompt(62, 150)
    ref = reference_tokens(reference_engine, [a, b], 140)
    client = pd.client(timeout=60)
    try:
        before = node_status(pd, "p1")["disaggregation"]["prefill"].get("done", 0)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            it = client.completions.create(model=MODEL, prompt=a, max_tokens=140, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
            chunks = iter(it)
            first = next(chunks).choices[0].text                 # A is decoding on d3 now
            running_b = pool.submit(stream, client, b, 10)
            text_a = first + "".join(c.choices[0].text for c in chunks)
            text_b, finish_b, usage_b = running_b.result(60)
        tok = reference_engine.tokenizer
        assert text_a == tok.decode(ref[0])
        assert text_b == tok.decode(ref[1][:10]) and finish_b == "length"
        st = node_status(pd, "d3")["disaggregation"]["decode"]
        assert st["no_blocks"] == 1 and st["remote"] == 1 and st["failed"] == 0, st
        # only A's prompt went through the prefill node
        assert node_status(pd, "p1")["disaggregation"]["prefill"].get("done", 0) == before + 1
        wait_idle(pd, ["d1", "d3", "p1"])
    finally:
        admin(pd.admin_socket, "undrain", node="d1")
    pd.nodes.pop("d3").stop()
    pd.wait_gone("d3", 10)


def test_prefill_node_that_dies_mid_request_is_recomputed(pd, reference_engine):
    """The prefill node stops (SIGSTOP: no answer, no heartbeat, no KV): the
    coordinator declares it dead and tells the decode node, which computes
    the prompt; the client sees the reference tokens (seeded), and blocks return."""
    import signal

    p = prompt(51, 60)
    ref = reference_tokens(reference_engine, [p], 8, SEEDED[1])[0]
    pd.wait_gone("d2", 10)
    proc = pd.nodes["p1"].proc
    proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream, pd.client(timeout=60), p, 8, SEEDED[1])
            forged = asyncio.run(forge_commit(pd))
            text, finish, _ = running.result(30)
        assert time.monotonic() - t0 < 12           # the heartbeat deadline (3 s), not a hang
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert [m.code for m in forged] == ["no_grant", "no_grant"], forged
    assert text == reference_engine.tokenizer.decode(ref)
    wait_idle(pd, ["d1"])


def test_a_short_prompt_is_not_queued_behind_a_long_one(tmp_path, reference_engine):
    """[cluster].prefill_queue_factor: p1 is stopped (SIGSTOP) with a 300-token
    prompt in its queue; a 20-token prompt may wait behind at most 4x its
    own tokens, so d1 computes it and it completes while p1 is frozen. The
    long prompt's KV never comes (d1 recomputes it past the 3 s transfer
    deadline). Both give the single-node engine's tokens; every block returns."""
    import signal

    c = start(tmp_path, "zmq+tcp", ROLES, extra=("--prefill-queue-factor", "4", "--heartbeat-deadline", "60"))
    try:
        long_p, short_p = prompt(61, 300), prompt(62, 20)
        ref = reference_tokens(reference_engine, [long_p, short_p], 8)
        tok = reference_engine.tokenizer
        proc = c.nodes["p1"].proc
        proc.send_signal(signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(stream, c.client(timeout=60), long_p, 8)
                deadline = time.monotonic() + 10
                while queue_of(c, "p1") != len(long_p):
                    assert time.monotonic() < deadline and not running.done(), "the long prompt never reached p1"
                    time.sleep(0.05)
                t0 = time.monotonic()
                text, finish, _ = stream(c.client(timeout=60), short_p, 8)
                took = time.monotonic() - t0
                assert not running.done()
                assert (text, finish) == (tok.decode(ref[1]), "length")
                assert took < 3                        # not the long prompt's transfer deadline
                assert admin(c.admin_socket, "status")["prefill_queue_bypassed"] == 1
                proc.send_signal(signal.SIGCONT)
                text_long, _, _ = running.result(30)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert text_long == tok.decode(ref[0])
        assert node_status(c, "d1")["disaggregation"]["decode"]["remote"] == 1   # the long one's grant
        wait_idle(c, ROLES)
    finally:
        c.stop()


def queue_of(c: Cluster, node: str) -> int:
    """The prompt tokens the coordinator has queued on ``node`` (``kvctl nodes``)."""
    return next(n["prefill_queue_tokens"] for n in admin(c.admin_socket, "nodes")["nodes"] if n["name"] == node)


async def forge_commit(c: Cluster) -> list:
    """The attacker's view: a node with a valid key of its own (m1), not the
    request's prefill node, finishes d1's open reservation with a forged
    first token and writes KV into it. Returns d1's replies."""
    from kvd import protocol

    deadline = time.monotonic() + 5
    while not (waiting := node_status(c, "d1")["disaggregation"]["decode"]["open"]):
        assert time.monotonic() < deadline, "d1 never reserved blocks"
        await asyncio.sleep(0.05)
    rx = waiting[0]
    c.make_key("m1")
    conn = await c.connect("d1", as_name="m1")
    try:
        commit = await protocol.call(conn, protocol.KVCommit(
            id="forged", deadline=time.time() + 5, transfer_id=rx["transfer_id"],
            request_id=rx["request_id"], status="done", first_token=13))
        data = await protocol.call(conn, protocol.KVData(
            id="forged-kv", deadline=time.time() + 5, transfer_id=rx["transfer_id"], layer_start=0,
            layer_end=1, block_ids=(0,), tensors=()))
    finally:
        await conn.close()
    return [commit, data]


def test_prefill_node_is_the_one_whose_cache_holds_the_prefix(tmp_path, reference_engine):
    """2P1D, prompt-tree routing: a prompt computed on p2 (p1 drained) leaves
    its prefix in p2's cache; later prompts sharing it go to p2 again (the
    prefill role's prompt tree), though least-load would pick idle p1 by
    name, and are served from that cache with the reference tokens."""
    roles = {"p1": "prefill", "p2": "prefill", "d1": "decode"}
    c = start(tmp_path, "zmq+tcp", roles)
    try:
        assert admin(c.admin_socket, "routing", policy="prompt-tree")["policy"] == "prompt-tree"
        client = c.client(timeout=60)
        system = prompt(70, 96)
        prompts = [system + prompt(71 + i, 17) for i in range(3)]
        ref = reference_tokens(reference_engine, prompts, 6)
        tok = reference_engine.tokenizer
        admin(c.admin_socket, "drain", node="p1")
        try:
            assert stream(client, prompts[0], 6)[0] == tok.decode(ref[0])
        finally:
            admin(c.admin_socket, "undrain", node="p1")
        for p, r in zip(prompts[1:], ref[1:]):
            text, _, usage = stream(client, p, 6)
            assert text == tok.decode(r)
            assert usage.prompt_tokens_details.cached_tokens >= 96     # p2's prefix cache
        done = {n: node_status(c, n)["disaggregation"]["prefill"].get("done", 0) for n in ("p1", "p2")}
        assert done == {"p1": 0, "p2": 3}
        wait_idle(c, roles)
    finally:
        c.stop()


@pytest.mark.parametrize("transport,dtype,roles", [
    ("zmq+ipc", "bfloat16", {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}),
    ("ucx", "float32", {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}),
    ("ucx", "bfloat16", {"p1": "prefill", "d1": "decode"}),
    ("zmq+tcp", "float32/float16", {"p1": "prefill", "d1": "decode"}),    # model / kv_cache_dtype
])
def test_topologies_transports_and_dtypes(tmp_path, transport, dtype, roles, reference_engine):
    from engine.engine import EngineConfig, LLMEngine

    dtype, _, kv_dtype = dtype.partition("/")
    ref_engine = reference_engine if dtype == "float32" and not kv_dtype else LLMEngine.from_config(EngineConfig(
        model="tiny", dtype=dtype, block_size=16, kv_blocks=256, host_kv_blocks=32, max_model_len=512,
        num_threads=1, kv_cache_dtype=kv_dtype or "auto"))
    if transport == "ucx":
        pytest.importorskip("ucxx")
    c = start(tmp_path, transport, roles,
              node_extra=("--dtype", dtype, *(("--kv-cache-dtype", kv_dtype) if kv_dtype else ())))
    try:
        system = prompt(90, 64)
        prompts = [prompt(i, n) for i, n in enumerate((7, 33, 120))] + [system + prompt(91 + i, 9) for i in range(4)]
        ref = reference_tokens(ref_engine, prompts, 10)
        client = c.client(timeout=60)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: stream(client, p, 10), prompts))
        tok = ref_engine.tokenizer
        assert [r[0] for r in results] == [tok.decode(r) for r in ref]
        decoders = [n for n, r in roles.items() if r == "decode"]
        remote = sum(node_status(c, n)["disaggregation"]["decode"]["remote"] for n in decoders)
        assert remote == len(prompts)
        wait_idle(c, roles)
    finally:
        c.stop()


def test_a_decode_node_with_another_kv_layout_is_answered_with_a_refusal(tmp_path, reference_engine):
    """A float16-cache prefill node and an fp32-cache decode node (kv_cache_dtype set on
    one only, an operator's mistake): the prefill node refuses the decode node's grant
    (KV layout mismatch), and the request still ends, in time, with the fp32 engine's
    tokens (the decode node computes the prompt itself) and no block left owned."""
    c = Cluster(tmp_path, "zmq+tcp", extra=("--prefill-queue-factor", "0"))
    try:
        c.start_node("p1", "--role", "prefill", "--prefill-threshold", "0", "--kv-transfer-timeout", "3",
                     "--kv-cache-dtype", "float16")
        c.start_node("d1", "--role", "decode", "--prefill-threshold", "0", "--kv-transfer-timeout", "3")
        c.wait_nodes(["d1", "p1"])
        ids = prompt(71, 40)
        want = reference_engine.tokenizer.decode(reference_tokens(reference_engine, [ids], 8)[0])
        t0 = time.monotonic()
        text, finish, _ = stream(c.client(timeout=60), ids, 8)
        assert time.monotonic() - t0 < 30
        assert (text, finish) == (want, "length")
        assert node_status(c, "p1")["kernels"]["kv_cache"] == "float16"
        st = node_status(c, "d1")["disaggregation"]["decode"]
        assert st["failed"] == 1 and st["remote"] == 0, st          # the refused leg, then its own prefill
        wait_idle(c, ["d1", "p1"])
    finally:
        c.stop()
