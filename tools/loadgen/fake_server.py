"""A trivial OpenAI-compatible SSE server, for tests and the generator benchmark.

It answers ``POST /v1/completions`` and ``/v1/chat/completions`` with
``max_tokens`` one-token chunks (``"t0 "``, ``"t1 "``, ...), a usage chunk when
asked and ``data: [DONE]``; ``GET /v1/models`` and ``GET /health`` too.  It is
raw asyncio over HTTP/1.1 keep-alive with chunked transfer encoding, so that
the benchmark measures the generator rather than a web framework.

Words in the prompt (or the last message) script unhappy paths:

=============  ===============================================================
``FAIL500``    HTTP 500 with an OpenAI-shaped error body
``ERRCHUNK``   one token, then ``data: {"error": ...}``
``DROP``       two tokens, then the connection closes mid-stream
``EMPTY``      a role chunk (chat), no text, usage with 0 completion tokens
``NOUSAGE``    no usage chunk even when asked
``SLOW``       TTFT and every token delayed by 50 ms
=============  ===============================================================

Run one standalone: ``python -m tools.loadgen.fake_server --port 8123``.
``WordTokenizer`` is the matching fake tokenizer (one token per word).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from dataclasses import dataclass

import orjson

MODEL = "fake"


@dataclass(frozen=True)
class FakeOptions:
    model: str = MODEL
    ttft_s: float = 0.0        # delay before the first token
    token_s: float = 0.0       # delay between tokens
    usage: bool = True         # honour stream_options.include_usage
    bodies: list | None = None  # when a list, every request body is appended (tests)


class WordTokenizer:
    """A fake tokenizer: token ``i`` is the word ``wi``; 0 is EOS, 1 is special.

    ``decode`` puts a space before every word, so decode/encode round-trips and
    concatenated texts keep their token counts -- what the datasets rely on.
    Words it does not know (the scripted ``FAIL500`` ...) encode as id 2.
    """

    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = (0,)
        self.bos_token_id = 1

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) if w[:1] == "w" and w[1:].isdigit() else 2 for w in text.split()]

    def decode(self, ids) -> str:
        return "".join(f" w{i}" for i in ids if i not in (0, 1))


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(obj) -> bytes:
    return _chunk(b"data: " + orjson.dumps(obj) + b"\n\n")


_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
             b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")


def _plain(status: str, body: bytes) -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status.encode(), len(body), body))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; requests are handled one at a time."""

    def __init__(self, opts: FakeOptions) -> None:
        self.opts = opts
        self.buf = bytearray()
        self.busy = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next_request()

    def _next_request(self) -> None:
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        method, path = head[0].split(" ")[:2]
        self.busy = True
        asyncio.get_running_loop().create_task(self._respond(method, path, body))

    async def _respond(self, method: str, path: str, body: bytes) -> None:
        try:
            await self._route(method, path, body)
        finally:
            self.busy = False
            self._next_request()

    async def _route(self, method: str, path: str, body: bytes) -> None:
        t = self.transport
        if method == "GET" and path == "/health":
            t.write(_plain("200 OK", b"{}"))
        elif method == "GET" and path == "/v1/models":
            t.write(_plain("200 OK", orjson.dumps({"object": "list", "data": [
                {"id": self.opts.model, "object": "model"}]})))
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            req = orjson.loads(body)
            if self.opts.bodies is not None:
                self.opts.bodies.append({"path": path, **req})
            await self._generate(path.endswith("chat/completions"), req)
        else:
            t.write(_plain("404 Not Found", b'{"error": {"message": "not found"}}'))

    async def _generate(self, chat: bool, req: dict) -> None:
        t = self.transport
        if chat:
            prompt = str(req["messages"][-1]["content"])
            prompt_tokens = sum(len(str(m["content"]).split()) for m in req["messages"])
        else:
            prompt = str(req["prompt"])
            prompt_tokens = len(prompt.split())
        words = set(prompt.split())
        if "FAIL500" in words:
            t.write(_plain("500 Internal Server Error", orjson.dumps(
                {"error": {"message": "scripted failure", "type": "server_error", "code": 500}})))
            return
        n = 0 if "EMPTY" in words else int(req.get("max_tokens") or 16)
        slow = 0.05 if "SLOW" in words else 0.0
        ttft_s, token_s = self.opts.ttft_s + slow, self.opts.token_s + slow
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": "cmpl-fake", "object": obj, "model": self.opts.model}
        out = [_SSE_HEAD]
        if chat:
            out.append(_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        if ttft_s:
            t.write(b"".join(out))
            out = []
            await asyncio.sleep(ttft_s)
        for i in range(n):
            if i and token_s:
                t.write(b"".join(out))
                out = []
                await asyncio.sleep(token_s)
            if t.is_closing():
                return
            last = i == n - 1
            choice = ({"index": 0, "delta": {"content": f"t{i} "}} if chat
                      else {"index": 0, "text": f"t{i} "})
            choice["finish_reason"] = "length" if last else None
            out.append(_event({**base, "choices": [choice]}))
            if "ERRCHUNK" in words:
                out.append(_event({"error": {"message": "scripted stream error", "code": 500}}))
                t.write(b"".join(out) + b"0\r\n\r\n")
                return
            if "DROP" in words and i == 1:
                t.write(b"".join(out))
                t.close()
                return
        want_usage = (req.get("stream_options") or {}).get("include_usage")
        if want_usage and self.opts.usage and "NOUSAGE" not in words:
            out.append(_event({**base, "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": n,
                "total_tokens": prompt_tokens + n}}))
        out.append(_DONE)
        t.write(b"".join(out))


async def serve(host: str, port: int, opts: FakeOptions) -> asyncio.base_events.Server:
    """Start listening; the caller owns the returned server (``close()`` it)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(opts), host, port, reuse_address=True)


class ServerThread:
    """The fake server on its own event loop in a daemon thread (for tests)."""

    def __init__(self, opts: FakeOptions = FakeOptions(), host: str = "127.0.0.1") -> None:
        self.opts = opts
        self.host = host
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(serve(self.host, 0, self.opts), self._loop)
        self._server = fut.result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        async def stop():
            self._server.close()
            await self._server.wait_closed()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def main() -> None:
    p = argparse.ArgumentParser(description="trivial OpenAI-compatible SSE server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    p.add_argument("--no-usage", action="store_true")
    args = p.parse_args()
    opts = FakeOptions(ttft_s=args.ttft, token_s=args.token_delay, usage=not args.no_usage)

    async def forever():
        server = await serve(args.host, args.port, opts)
        print(f"listening on http://{args.host}:{server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()

    try:
        import uvloop
        uvloop.run(forever())
    except ImportError:
        asyncio.run(forever())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
