"""Whose fault an error is: a request refused for its parameters answers 400
``invalid_request_error``; a request that fails while the engine runs it (the
server's fault) answers 500 ``server_error`` with code ``engine_error``, as a
response or as a stream's final event; the engine keeps serving the others."""

from __future__ import annotations

import httpx
import orjson
import pytest
from aiohttp.test_utils import TestServer

from engine.request import ENGINE_ERROR
from kvd.api.http import FrontDoor
from kvd.node.engine_driver import EngineDriver

from .test_engine_driver import tiny_engine


@pytest.fixture
async def front():
    """An in-process front door over a tiny engine whose output processor fails
    (injected: no valid parameter makes a request fail inside a step) for every
    request whose prompt starts with the word "poison"."""
    engine = tiny_engine()
    poison = engine.tokenizer.encode("poison")[:1]
    append = engine.outputs.append

    def faulty(req, token):
        if req.prompt_ids[:1] == poison and len(req.output_ids) == 1:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return append(req, token)
    engine.outputs.append = faulty
    driver = EngineDriver(engine)
    await driver.start()
    server = TestServer(FrontDoor(driver).make_app(), host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}"
    await server.close()
    await driver.stop()


def body(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}


async def test_a_request_failing_in_the_engine_is_a_500_not_the_clients_fault(front):
    async with httpx.AsyncClient(base_url=front, timeout=30) as http:
        r = await http.post("/v1/completions", json=body("poison pill"))
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == ENGINE_ERROR
        assert "failed in the engine" in err["message"] and "UnicodeDecodeError" in err["message"]
        # streaming: once the 200 is sent the failure is the last event; when the failure comes
        # with the first output the front door pulls (token 0 and its failure at token 1 merged
        # for a reader that was slower than the engine), it is still a 500
        async with http.stream("POST", "/v1/completions", json=body("poison pill", stream=True)) as s:
            if s.status_code == 200:
                events = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                final = orjson.loads(events[-2])["error"]
            else:
                assert s.status_code == 500
                final = orjson.loads(await s.aread())["error"]
        assert final["type"] == "server_error" and final["code"] == ENGINE_ERROR
        # a refused request is still the client's fault, and the engine serves the rest
        r = await http.post("/v1/completions", json=body("hello", max_tokens=100_000))
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.post("/v1/completions", json=body("hello"))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert (await http.get("/health")).status_code == 200
