"""Structured output in the engine (engine/structured/): greedy tokens under a
grammar are the argmax over the allowed tokens of the plain engine's logits,
seeded tokens the plain draw over the masked logits, on both decode paths;
guided and plain rows share a batch without touching each other; a recovered
or handed-over request replays its grammar over the tokens so far; a spec
that does not compile is refused before anything is queued."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from engine.request import InvalidParam, SamplingParams
from engine.sampling import make_generator, sample
from engine.structured.grammar import GrammarCompiler
from engine.structured.spec import StructuredOutput

from .test_logit_adjustments import next_logits
from .test_sampling_extremes import engine_on

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
SPECS = {
    "json_schema": StructuredOutput.json_schema(SCHEMA),
    "regex": StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,5}"),
    "choice": StructuredOutput("choice", ("yes", "no", "maybe not")),
}


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(rng.randint(8, 24))]


def allowed(compiler: GrammarCompiler, spec: StructuredOutput, tokens: list[int], vocab: int) -> torch.Tensor:
    """The tokens ``spec`` allows after ``tokens``: a bool [vocab], from a matcher of its own."""
    state = compiler.start(spec)
    assert state.replay(tokens), state.error
    words = np.frombuffer(state.matcher.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(words, bitorder="little")[:vocab].astype(bool))


def reference(eng, compiler, spec: StructuredOutput, ids: list[int], p: SamplingParams) -> list[int]:
    """The request's tokens one at a time in plain Python: the whole sequence's
    logits, every token the grammar refuses at -inf, then the plain draw of
    ``engine.sampling.sample`` (greedy: the first maximum), up to EOS."""
    out: list[int] = []
    gen = make_generator(p)
    while len(out) < p.max_tokens:
        logits = next_logits(eng.model, ids + out)
        logits[~allowed(compiler, spec, out, logits.shape[0])] = float("-inf")
        tok = sample(logits[None].contiguous(), [p], [gen], [len(out)])[0]
        out.append(tok)
        if tok in eng.tokenizer.eos_token_ids:
            break
    return out


@pytest.mark.parametrize("path", ["executor", "torch"])
@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
def test_tokens_under_a_grammar_are_the_plain_draw_over_the_allowed_tokens(make_tiny, tokenizer, path, kind,
                                                                           sampling):
    eng = engine_on(make_tiny, path)
    compiler = GrammarCompiler(tokenizer, eng.model.config.vocab_size)
    spec = SPECS[kind]
    p = SamplingParams(max_tokens=40, structured=spec, **sampling)
    prompts = [prompt(1), prompt(2)]
    plain = SamplingParams(max_tokens=40, ignore_eos=True, **sampling)
    # a guided row and a plain one share every step
    got, got_plain = eng.generate(prompts, [p, plain])
    assert got == reference(eng, compiler, spec, prompts[0], p)
    assert got_plain == eng.generate([prompts[1]], plain)[0]
    assert got[-1] in tokenizer.eos_token_ids, "the grammar completes within max_tokens"
    text = tokenizer.decode(got)
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "age", "ok"} and 0 <= value["age"] <= 120 and len(value["name"]) <= 6
    elif kind == "regex":
        import re
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text
    else:
        assert text in SPECS["choice"].value


def test_seeded_structured_output_is_reproducible_across_engines_and_batches(make_tiny, tokenizer):
    spec = StructuredOutput("json_object")
    p = SamplingParams(max_tokens=40, temperature=1.0, seed=11, structured=spec)
    one = make_tiny().generate([prompt(3)], p)[0]
    crowd = make_tiny().generate([prompt(4), prompt(3), prompt(5)], p)
    assert crowd[1] == one
    # cut by max_tokens or not, the text is a prefix the grammar accepts
    assert GrammarCompiler(tokenizer).start(spec).replay(one)
    assert tokenizer.decode(one).startswith("{")


def test_a_resumed_or_handed_over_request_replays_its_grammar(make_tiny):
    eng = make_tiny()
    spec = SPECS["json_schema"]
    p = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=spec)
    whole = eng.generate([prompt(6)], p)[0]
    for cut in (1, 5, len(whole) - 2):
        eng2 = make_tiny()
        assert eng2.resume_request("r", prompt(6), whole[:cut], p) is None
        rest = []
        while eng2.has_unfinished():
            for out in eng2.step():
                rest += out.new_token_ids
        assert whole[:cut] + rest == whole
    # tokens the grammar refuses cannot be resumed: nothing is queued
    bad = make_tiny()
    with pytest.raises(InvalidParam) as err:
        bad.resume_request("r", prompt(6), bad.tokenizer.encode("not json"), p)
    assert err.value.param == "output_token_ids"
    assert not bad.has_request("r") and not bad.has_unfinished()


@pytest.mark.parametrize("spec, needle", [
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (StructuredOutput.json_schema({"properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
    (StructuredOutput("regex", "([a-z"), "regex"),
])
def test_a_spec_that_does_not_compile_is_refused_and_nothing_is_queued(make_tiny, spec, needle):
    eng = make_tiny()
    with pytest.raises(InvalidParam) as err:
        eng.add_request("x", prompt(1), SamplingParams(structured=spec))
    assert needle in str(err.value)
    assert not eng.has_request("x") and not eng.has_unfinished()


def test_compiled_grammars_are_cached_by_spec(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    for _ in range(3):
        compiler.start(StructuredOutput.json_schema({"type": "object", "required": ["a"],
                                                     "properties": {"a": {"type": "integer"}}}))
        compiler.start(StructuredOutput.json_schema({"properties": {"a": {"type": "integer"}},
                                                     "required": ["a"], "type": "object"}))   # the same schema
    with pytest.raises(ValueError):
        compiler.check(StructuredOutput("regex", "(("))
    with pytest.raises(ValueError):
        compiler.check(StructuredOutput("regex", "(("))
    assert compiler.compiled == 2


def test_keys_are_written_in_the_schemas_properties_order(tokenizer):
    """``properties`` order is the output's key order (OpenAI's structured outputs): two
    schemas that differ in it alone are two specs, each allowing only its own order."""
    props = [("zeta", {"type": "integer"}), ("alpha", {"type": "integer"})]
    specs = [StructuredOutput.json_schema({"type": "object", "required": ["zeta", "alpha"],
                                           "properties": dict(order)}) for order in (props, props[::-1])]
    assert specs[0] != specs[1]
    compiler = GrammarCompiler(tokenizer)
    for spec, text in zip(specs, ('{"zeta":1,"alpha":2}', '{"alpha":2,"zeta":1}')):
        state = compiler.start(spec)
        assert state.replay(tokenizer.encode(text)) and state.complete, (spec.value, text)
        other = '{"alpha":2,"zeta":1}' if text.startswith('{"z') else '{"zeta":1,"alpha":2}'
        assert not compiler.start(spec).replay(tokenizer.encode(other))


@pytest.mark.parametrize("overlap", [False, True])
def test_masks_on_a_worker_thread_or_the_engine_thread_are_the_same(tokenizer, overlap):
    """Rows without a grammar are untouched; a guided row keeps exactly its allowed tokens."""
    from engine.structured.masks import MaskComputer

    compiler = GrammarCompiler(tokenizer, 49152)
    spec = SPECS["json_schema"]
    states = [None, compiler.start(spec), None, compiler.start(spec)]
    done = []
    for _ in range(3):                     # row 3 some tokens in: its last allowed token each time
        done.append(int(allowed(compiler, spec, done, 49152).nonzero()[-1]))
    assert states[3].replay(done)
    logits = torch.randn(4, 49152)
    before = logits.clone()
    masks = MaskComputer(49152, overlap=overlap)
    try:
        assert masks.start([None, None]) is None
        assert masks.start(states).apply(logits) == []
    finally:
        masks.close()
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row, done in ((1, []), (3, done)):
        keep = allowed(compiler, spec, done, 49152)
        assert torch.equal(logits[row][keep], before[row][keep])
        assert bool((logits[row][~keep] == float("-inf")).all()) and 0 < int(keep.sum()) < 49152


def test_with_ignore_eos_the_tokens_past_the_grammars_end_are_eos(make_tiny, tokenizer):
    eng = make_tiny()
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, structured=SPECS["choice"])
    out = eng.generate([prompt(8)], p)[0]
    assert len(out) == 12 and tokenizer.decode(out) in SPECS["choice"].value
    end = out.index(tokenizer.eos_token_ids[0])
    assert set(out[end:]) == {tokenizer.eos_token_ids[0]}


def test_min_tokens_holds_while_the_grammar_goes_on_and_not_past_its_end(make_tiny, tokenizer):
    eng = make_tiny()
    choice = eng.generate([prompt(9)], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=10,
                                                      structured=SPECS["choice"]))[0]
    assert tokenizer.decode(choice) in SPECS["choice"].value and choice[-1] in tokenizer.eos_token_ids
    letters = eng.generate([prompt(9)], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6,
                                                       structured=StructuredOutput("regex", "[a-z]+")))[0]
    assert len(letters) >= 6 and re.fullmatch("[a-z]+", tokenizer.decode(letters))
