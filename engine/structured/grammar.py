"""Grammars for structured output, on llguidance: the model's vocabulary as
the grammar library reads it, compiled grammars cached by spec, and one
request's matcher.

``GrammarCompiler`` turns a ``StructuredOutput`` into a compiled llguidance
matcher in its start state and keeps the last ``cache_size`` of them (and the
refusals) keyed by the spec: a request with a spec seen before copies the
compiled matcher (``LLMatcher.deep_copy``) instead of compiling. It is
thread-safe, so the node compiles a request's grammar on a worker thread,
off its event loop and off the engine's step, before the engine admits the
request (kvd/node/engine_driver.py); the engine then finds it cached.

The vocabulary is the model's own tokenizer's (engine/model/tokenizer.py,
``Tokenizer.token_bytes``: each id's bytes, the special ids), sized to the
model's vocabulary: ids the tokenizer lacks are never allowed.

What each kind compiles to (llguidance's grammar builders):

- ``json_schema``: the schema, with JSON's whitespace fixed (no free
  whitespace between tokens: a model cannot run on in spaces until
  max_tokens, and the text is compact JSON such as ``{"a":1,"b":[2,3]}``);
- ``json_object``: the schema ``{"type": "object"}``, the same way;
- ``regex``: the pattern, anchored at both ends (the whole output matches);
- ``choice``: one of the strings, exactly.

When the grammar is complete, only the model's EOS token is allowed: the
request stops there (unless ``ignore_eos``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from engine.model.tokenizer import Tokenizer
from engine.structured.spec import StructuredOutput, StructuredOutputError

# compiled grammars kept per process (a compiled JSON schema is tens to hundreds of KiB)
GRAMMAR_CACHE_SIZE = 256
JSON_OPTIONS = {"whitespace_flexible": False}
JSON_OBJECT_SCHEMA = {"type": "object"}


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (module docstring): not yet checked,
    ``GrammarCompiler.compile`` does. Raises StructuredOutputError for a schema
    llguidance cannot read as JSON."""
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        # Lark string literals take JSON's escapes: one alternative per choice
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
    schema = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.value
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise StructuredOutputError(f"the JSON schema cannot be used: {exc}"[:500]) from None


class GrammarState:
    """One request's grammar at its output tokens so far (an llguidance
    matcher). Mutated only by the engine thread; ``matcher`` is read by the
    mask computation (engine/structured/masks.py) while no token is being
    accepted."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance over ``token``; False when the grammar refuses it (the state is
        then an error for good: ``error`` says why)."""
        return self.matcher.consume_token(token)

    def replay(self, tokens: list[int]) -> bool:
        """Advance over ``tokens`` (a request's output so far, on the node that
        continues it); False when the grammar refuses one of them."""
        return self.matcher.consume_tokens(tokens) if tokens else True

    @property
    def complete(self) -> bool:
        """The grammar is complete and takes nothing more: EOS is the one token it allows."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the grammar refused a token ("" if it did not)."""
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiled grammars for one model's vocabulary (module docstring).
    Thread-safe; ``compile`` may take a while for a large schema (it holds no
    lock meanwhile, and llguidance releases the GIL)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None,
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher | str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0                   # grammars compiled (cache misses), for tests and stats

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance reads it, built on first use (one pass over it).
        Raises StructuredOutputError for a tokenizer whose ids are not byte strings."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_ll_tokenizer()
            return self._ll_tokenizer

    def _build_ll_tokenizer(self) -> llguidance.LLTokenizer:
        table = self._tokenizer.token_bytes
        if table is None:
            raise StructuredOutputError("structured output needs a byte-level tokenizer; this model's is not")
        token_bytes, special = table
        tokenizer = self._tokenizer
        eos = list(tokenizer.eos_token_ids)
        if not eos:
            raise StructuredOutputError("structured output needs the model's EOS token; this tokenizer has none")

        class Vocabulary:                   # what llguidance.TokenizerWrapper reads
            eos_token_id = eos[0]
            bos_token_id = tokenizer.bos_token_id
            tokens = list(token_bytes)
            special_token_ids = sorted(special)

            def __call__(self, text: bytes) -> list[int]:
                return tokenizer.encode(text.decode("utf-8", "replace"))

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=self.vocab_size,
                                      eos_token=eos)

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """``spec``'s matcher in its start state, compiled once and then cached (do
        not advance it: ``start`` copies it). Raises StructuredOutputError naming
        the problem when the spec does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is None:
            hit = self._compile(spec)
            with self._lock:
                self.compiled += 1
                self._cache[spec] = hit
                self._cache.move_to_end(spec)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise StructuredOutputError(hit)
        return hit

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher | str:
        """A compiled matcher, or the message of why ``spec`` does not compile."""
        what = {"json_object": "JSON object", "json_schema": "JSON schema", "regex": "regex",
                "choice": "choice"}[spec.kind]
        try:
            grammar = grammar_text(spec)
        except StructuredOutputError as exc:
            return str(exc)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"the {what} cannot be compiled: {matcher.get_error()}"[:1000]
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        """Raise StructuredOutputError when ``spec`` does not compile (compiling and
        caching it otherwise). Changes no request."""
        self.compile(spec)

    def start(self, spec: StructuredOutput) -> GrammarState:
        """A new request's grammar state (at its first output token). Raises
        StructuredOutputError when ``spec`` does not compile."""
        return GrammarState(self.compile(spec).deep_copy())
