"""The request function and the runner against the fake SSE server."""

import asyncio
import io
import math

import aiohttp
import pytest

from tools.loadgen.client import RequestRecord, build_body, error_message, send_request
from tools.loadgen.datasets import Conversation, Turn
from tools.loadgen.fake_server import FakeOptions, _Connection, serve
from tools.loadgen.runner import Progress, RunConfig, run, start_offsets


@pytest.fixture
async def server():
    bodies: list = []
    srv = await serve("127.0.0.1", 0, FakeOptions(bodies=bodies))
    srv.bodies = bodies
    srv.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    yield srv
    srv.close()
    await srv.wait_closed()


async def one(url: str, prompt: str, *, chat: bool, max_tokens: int = 4) -> RequestRecord:
    body = build_body(model="fake", chat=chat, prompt=prompt, max_tokens=max_tokens,
                      ignore_eos=True, temperature=0.0)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as http:
        return await send_request(http, url + endpoint, body, {}, chat, RequestRecord(index=0))


@pytest.mark.parametrize("chat", [False, True])
async def test_success_counts_usage_and_text(server, chat):
    rec = await one(server.url, "hello", chat=chat, max_tokens=5)
    assert rec.success and rec.error == ""
    assert rec.output_tokens == 5 and rec.chunks == 5 and rec.usage_reported
    assert rec.text == "t0 t1 t2 t3 t4 "
    assert len(rec.itl) == 4
    assert 0 < rec.ttft <= rec.e2el
    assert rec.finish_reason == "length"
    body = server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5


async def test_role_chunk_is_not_the_first_token(server):
    # SLOW delays the first token by 50 ms; the role chunk comes at once.
    rec = await one(server.url, "SLOW", chat=True, max_tokens=3)
    assert rec.success
    assert rec.ttft >= 0.05
    assert all(gap >= 0.05 for gap in rec.itl) and len(rec.itl) == 2
    assert rec.e2el >= rec.ttft + 0.1


async def test_without_usage_counts_chunks(server):
    rec = await one(server.url, "NOUSAGE", chat=False, max_tokens=3)
    assert rec.success and not rec.usage_reported
    assert rec.output_tokens == 3 and rec.prompt_tokens is None


@pytest.mark.parametrize("chat", [False, True])
async def test_empty_answer_is_a_success_with_ttft_at_the_end(server, chat):
    rec = await one(server.url, "EMPTY", chat=chat)
    assert rec.success and rec.chunks == 0 and rec.output_tokens == 0
    assert rec.ttft == rec.e2el and rec.itl == []


@pytest.mark.parametrize("prompt, error", [
    ("FAIL500", "HTTP 500: scripted failure"),
    ("ERRCHUNK", "stream error: scripted stream error"),
    ("DROP", None),   # aiohttp's payload error; its wording is aiohttp's
])
async def test_failures_keep_their_message(server, prompt, error):
    rec = await one(server.url, prompt, chat=False)
    assert not rec.success and rec.error
    if error:
        assert rec.error == error
    if prompt == "DROP":
        assert rec.chunks == 2 or "payload" in rec.error.lower()


async def test_unreachable_server_is_a_failure_record():
    rec = await one("http://127.0.0.1:9", "x", chat=False)   # port 9: discard, nothing listens
    assert not rec.success and "Connect" in rec.error


def test_error_message_shapes():
    assert error_message(400, b'{"error": {"message": "bad\\n  prompt"}}') == "HTTP 400: bad prompt"
    assert error_message(503, b"upstream down") == "HTTP 503: upstream down"
    assert error_message(502, b"") == "HTTP 502"
    assert error_message(429, b'{"error": "slow down"}') == "HTTP 429: slow down"


def test_start_offsets():
    assert start_offsets(4, math.inf, 1.0, 0).tolist() == [0, 0, 0, 0]
    offs = start_offsets(20000, 50.0, 1.0, 7)
    gaps = offs[1:] - offs[:-1]
    assert offs[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)       # mean rate is kept ...
    assert gaps.std() == pytest.approx(1 / 50, rel=0.1)         # ... Poisson: cv = 1
    steady = start_offsets(20000, 50.0, 16.0, 7)
    g2 = steady[1:] - steady[:-1]
    assert g2.mean() == pytest.approx(1 / 50, rel=0.05) and g2.std() < gaps.std() / 3
    assert (start_offsets(5, 10.0, 1.0, 3) == start_offsets(5, 10.0, 1.0, 3)).all()   # seeded


def single(texts, out=4):
    return [Conversation((Turn(t, len(t.split()), out),)) for t in texts]


async def test_run_counts_every_request_and_limits_concurrency(server):
    convs = single(["SLOW"] * 6 + ["FAIL500", "EMPTY"])
    cfg = RunConfig(url=server.url + "/v1/completions", model="fake", chat=False,
                    max_concurrency=2, progress=False)
    res = await run(convs, cfg)
    assert len(res.records) == 8 and [r.index for r in res.records] == list(range(8))
    assert sum(r.success for r in res.records) == 7
    assert [r.error for r in res.records if not r.success] == ["HTTP 500: scripted failure"]
    # never more than 2 requests in flight
    events = sorted([(r.start, 1) for r in res.records] + [(r.start + r.e2el, -1) for r in res.records],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak <= 2
    assert res.duration_s >= 3 * 0.2   # 6 slow requests, 2 at a time, >= 4 x 50 ms each


@pytest.mark.parametrize("chat", [True, False])
async def test_sessions_wait_for_answers_and_resend_history(server, chat):
    conv = Conversation((Turn("w1 w2", 2, 2), Turn("w3", 1, 3), Turn("w4", 1, 1)))
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    cfg = RunConfig(url=server.url + endpoint, model="fake", chat=chat, progress=False)
    res = await run([conv, conv], cfg)
    assert len(res.records) == 6 and all(r.success for r in res.records)
    for session in (0, 1):
        recs = [r for r in res.records if r.session == session]
        assert [r.turn for r in recs] == [0, 1, 2]
        for prev, nxt in zip(recs, recs[1:]):
            assert nxt.start >= prev.start + prev.e2el      # sent after the answer arrived
    bodies = [b for b in server.bodies if b["path"] == endpoint]
    last = bodies[-1]
    if chat:
        assert [m["role"] for m in last["messages"]] == ["user", "assistant", "user", "assistant", "user"]
        assert [m["content"] for m in last["messages"]] == ["w1 w2", "t0 t1 ", "w3", "t0 t1 t2 ", "w4"]
    else:
        # the answer continues its prompt; a newline opens the next message
        assert last["prompt"] == "w1 w2t0 t1 \nw3t0 t1 t2 \nw4"


async def test_a_session_thinks_between_turns(server):
    conv = Conversation((Turn("w1", 1, 2), Turn("w2", 1, 2), Turn("w3", 1, 2)))
    cfg = RunConfig(url=server.url + "/v1/completions", model="fake", chat=False, progress=False,
                    think_time_s=0.3)
    res = await run([conv], cfg)
    recs = sorted(res.records, key=lambda r: r.turn)
    assert all(r.success for r in recs)
    for prev, nxt in zip(recs, recs[1:]):
        assert nxt.start >= prev.start + prev.e2el + 0.3    # the answer, then the pause, then the turn
    assert res.duration_s < recs[-1].start + recs[-1].e2el + 0.3   # no pause after the last turn


async def test_failed_turn_ends_its_session_with_records(server):
    conv = Conversation((Turn("w1", 1, 2), Turn("FAIL500", 1, 2), Turn("w2", 1, 2), Turn("w3", 1, 2)))
    cfg = RunConfig(url=server.url + "/v1/chat/completions", model="fake", chat=True, progress=False)
    res = await run([conv], cfg)
    assert [r.success for r in res.records] == [True, False, False, False]
    assert res.records[2].error == "not sent: turn 1 of the session failed"


def test_run_config_validation():
    with pytest.raises(ValueError):
        RunConfig(url="http://x", model="m", chat=False, request_rate=-1)
    with pytest.raises(ValueError):
        RunConfig(url="http://x", model="m", chat=False, max_concurrency=0)
    with pytest.raises(ValueError):
        RunConfig(url="http://x", model="m", chat=False, think_time_s=-1)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_pipe_prints_a_line_per_tenth():
    out = io.StringIO()
    bar = Progress(20, enabled=True, out=out)
    for i in range(20):
        bar.update(success=i != 3)
    bar.note("fault n1@1s (exit): ok")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 12 and lines[-2].startswith("    20/20 [") and "failed=1" in lines[-2]
    assert lines[-1] == "fault n1@1s (exit): ok"


def test_progress_on_a_terminal_redraws_one_line():
    out = FakeTTY()
    bar = Progress(3, enabled=True, out=out)
    for _ in range(3):
        bar.update(success=True)
    bar.close()
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    assert "3/3" in text
    silent = io.StringIO()
    off = Progress(3, enabled=False, out=silent)
    off.update(True)
    off.close()
    assert silent.getvalue() == ""


@pytest.mark.parametrize("keepalive", [True, False])
async def test_no_keepalive_opens_a_connection_per_request(keepalive):
    """--no-keepalive: one connection per request (llama-server drops idle keep-alive
    connections under load, failing the next request sent on one); the default reuses."""
    import asyncio

    from tools.loadgen.fake_server import _Connection
    opts, made = FakeOptions(), []

    def connection():
        made.append(1)
        return _Connection(opts)

    srv = await asyncio.get_running_loop().create_server(connection, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/completions"
        cfg = RunConfig(url=url, model="fake", chat=False, max_concurrency=1, progress=False,
                        keepalive=keepalive)
        res = await run(single(["a", "b", "c", "d"]), cfg)
    finally:
        srv.close()
        await srv.wait_closed()
    assert all(r.success for r in res.records) and len(res.records) == 4
    assert len(made) == (1 if keepalive else 4)
