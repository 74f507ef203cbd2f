"""The OpenAI-compatible HTTP front door (aiohttp, SSE, orjson).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and
not), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Contracts:

- Bad input never reaches the engine: bodies are validated (``schema.py``) and
  token counts checked before ``generate``; errors are OpenAI-shaped.
- Work is bounded before it is done: a body over ``max_body_bytes`` is 413, one
  not received within ``body_timeout`` 408 (both close the connection); a
  prompt is refused by its bytes before it is tokenized, and a big body is
  parsed and tokenized off the event loop (``prompt.py``).
- /health is 200 only when a request could run: 503 while draining, 503
  with the reason when no node can serve, and 503 ``engine_dead`` naming the
  cause once ``engine_died`` was called (the embedded ``kvd serve``, whose
  engine thread died: it then stops).
- A dead engine is never the client's fault: open and new requests get 503
  ``engine_dead`` (``service_unavailable``), a stream under way a final
  error event with it and ``data: [DONE]``.
- A client that disconnects cancels its handler (``handler_cancellation``);
  closing the engine stream aborts the request, which frees its blocks.
- While draining (SIGTERM), new generation requests get 503; open ones finish.
  ``end_requests`` (the drain's deadline, or a second signal) ends those still
  open at once: a stream with a final error event (code ``shutdown``) and
  ``data: [DONE]``, a request not streaming yet with a 503; their engine
  requests are aborted.
- The engine is reached only through :class:`EngineClient`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import replace

import orjson
from aiohttp import web

from engine.request import INVALID_REQUEST, InvalidParam, RequestOutput, SamplingParams
from kvd.api.choices import Choice, usage_output
from kvd.api.copies import generate_copies
from kvd.api.logprobs import TokenText
from engine.structured.grammar import GrammarCompiler
from engine.structured.spec import StructuredOutputError
from kvd.api.prompt import PromptBuilder
from kvd.api.schema import ApiError, ApiRequest, bad
from kvd.config import ServerConfig
from kvd.engine_client import EngineClient, EngineDead
from kvd.metrics import ServerMetrics
from kvd.protocol import prompt_logprobs_fit

log = logging.getLogger("kvd.http")

_DEFAULTS = ServerConfig()
GRAMMAR_CHECK_TIMEOUT_S = 30.0   # a structured-output spec compiles within this, or is refused
END_WRITE_TIMEOUT_S = 1.0   # a stream's final error event: a client that does not read cannot hold it


class FrontDoor:
    """State shared by the handlers: the engine client, metrics, drain flag."""

    def __init__(self, client: EngineClient, api_key: str | None = None,
                 served_model_name: str | None = None, *,
                 max_body_bytes: int = _DEFAULTS.max_body_bytes,
                 body_timeout: float = _DEFAULTS.body_timeout) -> None:
        self.client = client
        self.api_key = api_key.encode() if api_key else None
        self.model_name = served_model_name or client.model_name
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.prompts = PromptBuilder(client.tokenizer, self.model_name)
        self.grammars = GrammarCompiler(client.tokenizer)     # structured output: specs checked here
        self.token_text = TokenText(client.tokenizer)
        self.metrics = ServerMetrics(client.stats, self.model_name)
        self.draining = False
        self.in_flight = 0
        self.ending: ApiError | None = None           # set by end_requests: what open requests answer
        self.engine_dead: ApiError | None = None      # set by engine_died: what /health and requests answer
        self._handlers: set[asyncio.Task] = set()     # generation handlers, from body to last byte

    # ------------------------------------------------------------- app
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[self._errors_middleware, self._auth_middleware])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_handler)

        async def close_prompts(app: web.Application) -> None:
            self.prompts.close()
        app.on_cleanup.append(close_prompts)
        return app

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            resp = json_response(exc.body(), status=exc.status)
            if exc.status in (408, 413):
                resp.force_close()        # the body was not read in full: the connection is spent
            if exc.status == 408:         # and its client is not sending it: close now, no lingering
                await resp.prepare(request)
                await resp.write_eof()
                request.protocol.force_close()
            return resp
        except web.HTTPException as exc:
            if exc.status >= 400:
                kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
                return json_response(ApiError(exc.status, exc.reason, type=kind).body(), status=exc.status)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return json_response(ApiError(500, "internal server error", type="server_error").body(),
                                 status=500)

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler):
        if self.api_key is not None and request.path.startswith("/v1/"):
            header = request.headers.get("Authorization", "")
            token = header[7:].encode() if header.startswith("Bearer ") else b""
            if not hmac.compare_digest(token, self.api_key):
                raise ApiError(401, "invalid or missing API key", type="authentication_error",
                               code="invalid_api_key")
        return await handler(request)

    # -------------------------------------------------------- simple routes
    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "kvd",
            "max_model_len": self.client.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        """200 ``{"status": "ok"}`` when a request could run now; else 503 with
        ``status`` "engine_dead", "draining" or "unavailable", and the reason as
        an OpenAI error."""
        if self.engine_dead is not None:
            return json_response({"status": "engine_dead", **self.engine_dead.body()}, status=503)
        if self.draining:
            error = ApiError(503, "server is draining; retry on another replica",
                             type="service_unavailable", code="draining")
            return json_response({"status": "draining", **error.body()}, status=503)
        if (reason := self.client.unavailable()) is not None:
            error = ApiError(503, reason, type="service_unavailable", code="no_node_available")
            return json_response({"status": "unavailable", **error.body()}, status=503)
        return json_response({"status": "ok"})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ---------------------------------------------------------- generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._endable("completions", self._generate(request, chat=False))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._endable("chat", self._generate(request, chat=True))

    def engine_died(self, cause: str) -> None:
        """The engine behind this front door died and will not come back in this
        process (``cause``: the exception). From now on /health and every new
        generation request answer 503 ``engine_dead`` naming it; a request open
        now gets it when it reaches the engine (a stream: as its last event).
        The caller stops the server: a supervisor restarts it."""
        self.engine_dead = engine_dead_error(f"the engine died ({cause}); retry the request")

    @property
    def open_requests(self) -> int:
        """Generation requests whose handler has not returned (reading, tokenizing, streaming)."""
        return len(self._handlers)

    def end_requests(self, message: str) -> int:
        """End every open generation request now (the drain's deadline, a second
        signal): a stream writes a final error event (code ``shutdown``) and
        ``data: [DONE]``, any other request answers 503 with that error; their
        engine requests are aborted. Each handler is cancelled, and turns its own
        cancellation into that answer (``_shutdown_cancelled``). New requests
        should already get 503 (``draining``). Returns how many were open."""
        self.ending = ApiError(503, message, type="service_unavailable", code="shutdown")
        for task in self._handlers:
            task.cancel()
        return len(self._handlers)

    def _shutdown_cancelled(self, task: asyncio.Task) -> bool:
        """Whether ``task``'s cancellation came from ``end_requests`` and from
        nothing else: then it is consumed (the handler answers ``self.ending``);
        otherwise (a client that went away, a server closing) it must propagate."""
        return self.ending is not None and task.uncancel() == 0

    async def _endable(self, endpoint: str, generate) -> web.StreamResponse:
        """Run a generation handler as an open request that ``end_requests`` can
        end: cancelled before its stream began, it answers 503 ``shutdown`` (a
        stream under way writes that error as its last event in ``_write_stream``)."""
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            return await generate
        except asyncio.CancelledError:
            if not self._shutdown_cancelled(task):
                raise
            self.metrics.requests.labels(endpoint, "503").inc()
            raise self.ending from None
        finally:
            self._handlers.discard(task)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        if self.engine_dead is not None:
            self.metrics.requests.labels(endpoint, "503").inc()
            raise self.engine_dead
        if self.draining:
            self.metrics.requests.labels(endpoint, "503").inc()
            raise ApiError(503, "server is draining; retry on another replica",
                           type="service_unavailable", code="draining")
        try:
            raw = await read_body(request, self.max_body_bytes, self.body_timeout)
            max_model_len = self.client.max_model_len      # on the loop: membership is its own
            req, prompt_ids = await self.prompts.build(raw, chat, max_model_len)
            await self._check_structured(req)
            req = replace(req, params=self._final_params(req, prompt_ids, chat, max_model_len))
        except ApiError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        self.in_flight += 1
        try:
            if req.stream:
                return await self._stream(request, req, prompt_ids, chat, endpoint)
            return await self._complete(req, prompt_ids, chat, endpoint)
        finally:
            self.in_flight -= 1

    async def _check_structured(self, req: ApiRequest) -> None:
        """Refuse with a 400 naming the body field a structured-output spec that does not
        compile (or not within GRAMMAR_CHECK_TIMEOUT_S). It compiles on a worker thread,
        off the event loop; the compiler caches it, so a spec seen before costs nothing."""
        spec = req.params.structured
        if spec is None:
            return
        try:
            async with asyncio.timeout(GRAMMAR_CHECK_TIMEOUT_S):
                await asyncio.to_thread(self.grammars.check, spec)
        except StructuredOutputError as exc:
            raise bad(req.structured_field, str(exc), exc.code) from None
        except TimeoutError:
            raise bad(req.structured_field, f"the structured output spec did not compile within "
                      f"{GRAMMAR_CHECK_TIMEOUT_S:g}s") from None

    def _final_params(self, req: ApiRequest, ids: list[int], chat: bool,
                      max_model_len: int) -> SamplingParams:
        """The sampling params to run (chat's default max_tokens is the rest of
        the context, as in vLLM), once the engine said the request can run.
        Raises ApiError."""
        params = req.params
        if not req.max_tokens_given and chat:
            params = replace(params, max_tokens=max(1, max_model_len - len(ids)))
        try:
            self.client.check_request(len(ids), params)
        except InvalidParam as exc:
            raise bad(exc.param, str(exc), code="context_length_exceeded") from None
        k = params.prompt_logprobs
        if k is not None and not prompt_logprobs_fit(len(ids), k):
            raise bad("logprobs", f"echo with logprobs={k} over a prompt of {len(ids)} tokens is more prompt "
                      "logprobs than one answer carries between nodes; ask fewer top logprobs or send a "
                      "shorter prompt")
        return params

    async def _complete(self, req: ApiRequest, prompt_ids: list[int], chat: bool,
                        endpoint: str) -> web.Response:
        rid = new_id("chatcmpl" if chat else "cmpl")
        t0 = time.perf_counter()
        first_at = None
        choices = self._choices(req, prompt_ids, chat)
        outputs = self._outputs(rid, prompt_ids, req)
        try:
            async for index, out in outputs:
                if first_at is None and out.new_token_ids:
                    first_at = time.perf_counter()
                choices[index].add(out)
        finally:
            await outputs.aclose()            # on cancellation: aborts the request now
        last = usage_output(choices)
        self._observe(endpoint, t0, first_at, last)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        return json_response({**self._head(rid, obj, created), "choices": [c.body() for c in choices],
                              "usage": usage(last)})

    def _head(self, rid: str, obj: str, created: int) -> dict:
        """The fields every response body and stream chunk starts with; ``system_fingerprint``
        names the build that computed it (engine/fingerprint.py), None while no node serves."""
        return {"id": rid, "object": obj, "created": created, "model": self.model_name,
                "system_fingerprint": self.client.fingerprint or None}

    def _choices(self, req: ApiRequest, prompt_ids: list[int], chat: bool) -> list[Choice]:
        return [Choice(i, req, prompt_ids, chat, self.token_text, req.prompt_text) for i in range(req.n)]

    async def _stream(self, request: web.Request, req: ApiRequest, prompt_ids: list[int],
                      chat: bool, endpoint: str) -> web.StreamResponse:
        rid = new_id("chatcmpl" if chat else "cmpl")
        t0 = time.perf_counter()
        outputs = self._outputs(rid, prompt_ids, req)
        try:
            return await self._write_stream(request, req, outputs, rid, chat, endpoint, t0,
                                            self._choices(req, prompt_ids, chat))
        finally:
            await outputs.aclose()            # on disconnect: aborts the request now

    async def _write_stream(self, request, req, outputs, rid, chat, endpoint, t0, choices):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = self._head(rid, obj, created)      # every chunk's first fields: one fingerprint per stream
        # pull the first output before committing to a 200: an engine-side
        # rejection can then still become a proper error status
        first = await anext(outputs)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})

        def chunk(index: int, delta_text: str | None, finish: str | None, stop_reason=None, role: bool = False,
                  logprobs: dict | None = None) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {"content": delta_text}
                if finish is not None and delta_text == "":
                    delta = {}
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta_text, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            return sse({**head, "choices": [choice]})

        first_at, last, done = None, None, False
        try:
            await resp.prepare(request)
            if chat:
                for c in choices:
                    await resp.write(chunk(c.index, None, None, role=True))
            item = first
            while item is not None:
                index, out = item
                if first_at is None and out.new_token_ids:
                    first_at = time.perf_counter()
                text, logprobs = choices[index].add(out)
                if text or out.finished or logprobs is not None:
                    await resp.write(chunk(index, text, out.finish_reason if out.finished else None,
                                           out.stop_reason, logprobs=logprobs))
                item = await anext(outputs, None)
            last = usage_output(choices)
            if req.include_usage:
                await resp.write(sse({**head, "choices": [], "usage": usage(last)}))
            done = True
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ApiError as exc:
            error = exc
        except asyncio.CancelledError:
            if not self._shutdown_cancelled(asyncio.current_task()):
                raise
            if done:                          # [DONE] is on its way: nothing left to end
                return resp
            error = self.ending
        else:
            self._observe(endpoint, t0, first_at, last)
            return resp
        if not resp.prepared:                 # cancelled before the 200 went out
            raise error
        # the 200 is already sent: end the stream with an error event (the
        # openai client raises APIError on it), as vLLM does
        self.metrics.requests.labels(endpoint, str(error.status)).inc()
        await end_stream(resp, error)
        return resp

    async def _outputs(self, rid: str, prompt_ids: list[int], req: ApiRequest):
        """(choice index, engine output) for the request's ``n`` copies
        (kvd/api/copies.py); engine-side rejections become ApiErrors."""
        copies = generate_copies(self.client, rid, prompt_ids, req.params, req.n)
        try:
            async for index, out in copies:
                if out.error is not None:
                    raise request_error(out)
                yield index, out
        except EngineDead as exc:
            raise self.engine_dead or engine_dead_error(str(exc)) from None
        finally:
            await copies.aclose()             # aborts the copies still running

    def _observe(self, endpoint: str, t0: float, first_at: float | None, last: RequestOutput | None) -> None:
        now = time.perf_counter()
        self.metrics.requests.labels(endpoint, "200").inc()
        self.metrics.e2e.observe(now - t0)
        if first_at is not None:
            self.metrics.ttft.observe(first_at - t0)
            if last is not None and last.num_output_tokens > 1:
                self.metrics.tpot.observe((now - first_at) / (last.num_output_tokens - 1))


def request_error(out: RequestOutput) -> ApiError:
    """The error of a request that ended with ``out.error``: a 400 when the request
    was refused (the client's fault), a 503 when a draining node refused it, else a
    500 naming the server-side code (it failed while running)."""
    if out.error_code in (None, INVALID_REQUEST):
        return bad(None, out.error)
    if out.error_code == "draining":
        return ApiError(503, out.error, type="service_unavailable", code="draining")
    return ApiError(500, out.error, type="server_error", code=out.error_code)


def engine_dead_error(message: str) -> ApiError:
    """The error of a request the engine cannot run because it (or the node
    running it) is gone: 503, not the client's fault."""
    return ApiError(503, message, type="service_unavailable", code="engine_dead")


def usage(out: RequestOutput | None) -> dict:
    p = out.num_prompt_tokens if out else 0
    c = out.num_output_tokens if out else 0
    cached = out.num_cached_tokens if out else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def end_stream(resp: web.StreamResponse, error: ApiError) -> None:
    """Write ``error`` as a stream's last event, then ``data: [DONE]``; bounded
    by END_WRITE_TIMEOUT_S, so a client that stopped reading cannot hold it."""
    try:
        async with asyncio.timeout(END_WRITE_TIMEOUT_S):
            await resp.write(sse(error.body()) + b"data: [DONE]\n\n")
            await resp.write_eof()
    except TimeoutError:
        log.info("a stream's final error event was not taken within %gs", END_WRITE_TIMEOUT_S)


def json_response(obj: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def read_body(request: web.Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body: at most ``max_bytes`` (413, refused by its Content-Length
    before any is read when it declares one) within ``timeout`` seconds (408)."""
    too_large = ApiError(413, f"request body exceeds {max_bytes} bytes", code="body_too_large")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g}s",
                       code="body_timeout") from None
