"""The seam between the HTTP front door and whatever runs the engine.

The HTTP layer sees only :class:`EngineClient`: validate, generate (an async
stream of :class:`RequestOutput` deltas), abort, stats. Implementations:

- :class:`kvd.node.engine_driver.EngineDriver` runs an :class:`LLMEngine` in
  one dedicated thread of this process (what a node daemon drives);
- :class:`kvd.coordinator.client.RemoteEngineClient` routes each request to a
  node over a transport (the coordinator; also the embedded ``kvd serve``).

``kvd/api/http.py`` never changes when the engine moves to other processes
or machines. This module imports no torch (the coordinator imports it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.model.tokenizer import Tokenizer
from engine.request import RequestOutput, SamplingParams


class EngineClient(Protocol):
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    fingerprint: str          # the build fingerprint of what computes the tokens (engine/fingerprint.py); "": none yet

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise InvalidParam if the request can never run. No side effects."""

    def generate(self, request_id: str, prompt_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream deltas until one has ``finished``. Closing the iterator early aborts.
        Raises EngineDead when the engine (or the node running it) is gone."""

    async def abort(self, request_id: str) -> None: ...

    def unavailable(self) -> str | None:
        """Why no request could run now (for /health's 503), or None. No side effects."""

    def stats(self) -> dict: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class EngineDead(RuntimeError):
    """The engine stopped (thread died, node lost); every open stream ends with this error."""

