"""Structured output: a request's grammar (JSON object, JSON schema, regex,
choice) forces the tokens it may sample.

- ``spec.py``: ``StructuredOutput``, the typed spec a request carries (HTTP,
  wire, engine: one definition, validated where it is built);
- ``grammar.py``: ``GrammarCompiler``, the model's vocabulary as llguidance
  sees it and the cache of compiled grammars; ``GrammarState``, one request's
  matcher, advanced token by token and rebuilt from the tokens so far;
- ``masks.py``: ``MaskComputer``, each step's allowed-token bitmasks, computed
  while the model runs, applied to the logits before sampling.
"""
