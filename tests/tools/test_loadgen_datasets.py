"""Datasets: lengths in the model's tokens, sharing structure, files, errors."""

import json

import numpy as np
import pytest

from tools.loadgen.datasets import (DatasetError, DatasetOptions, TokenSampler, allowed_token_ids,
                                    build)
from tools.loadgen.fake_server import WordTokenizer

TOK = WordTokenizer(vocab_size=500)


def turns(convs):
    return [t for c in convs for t in c.turns]


def test_special_tokens_are_never_sampled():
    ids = allowed_token_ids(TOK)
    assert 0 not in ids and 1 not in ids and len(ids) == 498
    text, n = TokenSampler(TOK, np.random.default_rng(0)).text(2000)
    assert n == 2000 and not {0, 1} & set(TOK.encode(text))


def test_random_lengths_are_exact_and_in_range():
    opts = DatasetOptions(name="random", num_prompts=200, random_input_len=40, random_output_len=10,
                          random_range_ratio=0.5, seed=3)
    ts = turns(build(opts, TOK))
    assert len(ts) == 200
    assert all(len(TOK.encode(t.text)) == t.prompt_len for t in ts)
    assert min(t.prompt_len for t in ts) >= 20 and max(t.prompt_len for t in ts) <= 60
    assert min(t.output_len for t in ts) >= 5 and max(t.output_len for t in ts) <= 15
    assert len({t.prompt_len for t in ts}) > 10
    assert turns(build(opts, TOK)) == ts                       # same seed, same prompts
    assert turns(build(DatasetOptions(**{**vars(opts), "seed": 4}), TOK)) != ts


def test_random_without_range_is_fixed():
    ts = turns(build(DatasetOptions(name="random", num_prompts=5, random_input_len=7,
                                    random_output_len=3), TOK))
    assert {(t.prompt_len, t.output_len) for t in ts} == {(7, 3)}


def test_prefix_repetition_shares_prefixes():
    opts = DatasetOptions(name="prefix-repetition", num_prompts=12, prefix_repetition_num_prefixes=3,
                          prefix_repetition_prefix_len=8, prefix_repetition_suffix_len=4,
                          prefix_repetition_output_len=5)
    ts = turns(build(opts, TOK))
    assert len(ts) == 12 and all(t.prompt_len == 12 and t.output_len == 5 for t in ts)
    prefixes = [tuple(TOK.encode(t.text)[:8]) for t in ts]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({t.text for t in ts}) == 12                     # suffixes differ


def test_sessions_shape_and_shared_prefix():
    opts = DatasetOptions(name="sessions", num_prompts=3, sessions_num_turns=4, sessions_user_len=6,
                          sessions_output_len=2, sessions_shared_prefix_len=5)
    convs = build(opts, TOK)
    assert len(convs) == 3 and all(len(c.turns) == 4 for c in convs)
    firsts = [c.turns[0] for c in convs]
    assert all(t.prompt_len == 11 for t in firsts)
    assert len({tuple(TOK.encode(t.text)[:5]) for t in firsts}) == 1   # one shared prefix
    later = [t for c in convs for t in c.turns[1:]]
    assert all(t.prompt_len == 6 and t.output_len == 2 for t in later)


def test_sharegpt_first_exchange_and_filters(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "w5 w6 w7 w8"}, {"from": "gpt", "value": "w9 w10 w11 w12 w13"}]},
        {"conversations": [{"from": "human", "value": "w5 w6"}, {"from": "gpt", "value": "w9 w10 w11 w12"}]},  # prompt < 4
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "w3 " * 1100}, {"from": "gpt", "value": "w4 w4 w4 w4"}]},  # too long
        {"id": "no conversations"},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    ts = turns(build(DatasetOptions(name="sharegpt", num_prompts=3, dataset_path=str(path)), TOK))
    assert [(t.text, t.prompt_len, t.output_len) for t in ts] == [("w5 w6 w7 w8", 4, 5)] * 3
    ts = turns(build(DatasetOptions(name="sharegpt", num_prompts=1, dataset_path=str(path),
                                    sharegpt_output_len=7), TOK))
    assert ts[0].output_len == 7


def test_file_one_prompt_per_line_cycled(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("w5 w6\n\n   \nw7 w8 w9\n")
    ts = turns(build(DatasetOptions(name="file", num_prompts=5, dataset_path=str(path),
                                    file_output_len=9), TOK))
    assert [(t.text, t.prompt_len, t.output_len) for t in ts] == [
        ("w5 w6", 2, 9), ("w7 w8 w9", 3, 9), ("w5 w6", 2, 9), ("w7 w8 w9", 3, 9), ("w5 w6", 2, 9)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="nope"), "unknown dataset"),
    (dict(name="file"), "needs --dataset-path"),
    (dict(name="sharegpt", dataset_path="/does/not/exist.json"), "not found"),
    (dict(num_prompts=0), "--num-prompts"),
    (dict(random_range_ratio=1.0), "--random-range-ratio"),
    (dict(random_input_len=0), "--random-input-len"),
    (dict(prefix_repetition_prefix_len=-1), "--prefix-repetition-prefix-len"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(DatasetError, match=message):
        DatasetOptions(**kwargs)


def test_bad_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match="no prompts"):
        build(DatasetOptions(name="file", dataset_path=str(empty)), TOK)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DatasetError, match="cannot read ShareGPT"):
        build(DatasetOptions(name="sharegpt", dataset_path=str(broken)), TOK)
    notlist = tmp_path / "obj.json"
    notlist.write_text('{"a": 1}')
    with pytest.raises(DatasetError, match="JSON list"):
        build(DatasetOptions(name="sharegpt", dataset_path=str(notlist)), TOK)
