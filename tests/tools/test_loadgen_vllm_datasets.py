"""The datasets vLLM's ``bench serve`` names: random with a prefix, custom JSONL,
sonnet; lengths measured with the real SmolLM2 tokenizer and its chat template."""

import json

import pytest

from tools.loadgen import sonnet
from tools.loadgen.datasets import DatasetError, DatasetOptions, build, chat_rendered
from tools.loadgen.fake_server import WordTokenizer

WORDS = WordTokenizer(vocab_size=500)


@pytest.fixture(scope="module")
def tok():
    from engine.model.registry import load_tokenizer
    return load_tokenizer("smollm2")


def turns(convs):
    return [t for c in convs for t in c.turns]


def test_random_prefix_is_shared_and_lengths_follow_vllm_bounds():
    opts = DatasetOptions(name="random", num_prompts=50, random_input_len=10, random_output_len=10,
                          random_range_ratio=0.25, random_prefix_len=30, seed=1)
    ts = turns(build(opts, WORDS))
    heads = {tuple(WORDS.encode(t.text)[:30]) for t in ts}
    assert len(heads) == 1                                       # one prefix, every prompt
    # input part on [floor(10*0.75), ceil(10*1.25)] = [7, 13], after the 30 prefix tokens
    assert {t.prompt_len for t in ts} <= set(range(37, 44)) and len({t.prompt_len for t in ts}) > 3
    assert {t.output_len for t in ts} <= set(range(7, 14))
    assert all(len(WORDS.encode(t.text)) == t.prompt_len for t in ts)


def test_prefix_repetition_spellings_are_one_dataset():
    kw = dict(num_prompts=8, prefix_repetition_num_prefixes=2, prefix_repetition_prefix_len=5,
              prefix_repetition_suffix_len=3, seed=2)
    assert build(DatasetOptions(name="prefix_repetition", **kw), WORDS) == \
        build(DatasetOptions(name="prefix-repetition", **kw), WORDS)


def test_custom_jsonl_rendered_for_completions_and_plain_for_chat(tmp_path, tok):
    path = tmp_path / "data.jsonl"
    prompts = ["What is the capital of India?", "What is the capital of Iran?",
               "What is the capital of China?"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    base = dict(name="custom", dataset_path=str(path), num_prompts=5, custom_output_len=7)
    rendered = turns(build(DatasetOptions(**base), tok))
    assert len(rendered) == 5 and {t.output_len for t in rendered} == {7}
    assert {t.text for t in rendered} == {chat_rendered(tok, p) for p in prompts}
    assert all(t.prompt_len == len(tok.encode(t.text)) for t in rendered)
    plain = turns(build(DatasetOptions(**base, chat=True), tok))
    assert {t.text for t in plain} == set(prompts)
    skipped = turns(build(DatasetOptions(**base, skip_chat_template=True, shuffle=False), tok))
    assert [t.text for t in skipped] == prompts + prompts[:2]      # file order, cycled
    shuffled = [t.text for t in turns(build(DatasetOptions(**base, skip_chat_template=True, seed=5), tok))]
    assert sorted(shuffled[:3]) == sorted(prompts)


@pytest.mark.parametrize("content, message", [
    ('{"text": "no prompt"}\n', 'string "prompt"'),
    ("not json\n", "not JSON"),
    ("\n\n", "no prompts"),
])
def test_custom_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        build(DatasetOptions(name="custom", dataset_path=str(path), skip_chat_template=True), WORDS)


def test_custom_needs_a_chat_template_for_completions(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DatasetError, match="no chat template"):
        build(DatasetOptions(name="custom", dataset_path=str(path)), WORDS)


def test_sonnet_prompts_share_the_opening_and_fit_the_input_len(tok):
    opts = DatasetOptions(name="sonnet", num_prompts=6, sonnet_input_len=300, sonnet_prefix_len=120,
                          sonnet_output_len=9, seed=3)
    ts = turns(build(opts, tok))
    lines = sonnet.read_lines(sonnet.BUNDLED_TEXT)
    assert len(lines) >= 250 and len(ts) == 6 and {t.output_len for t in ts} == {9}
    template_head = chat_rendered(tok, "MARK").split("MARK")[0]
    for t in ts:     # the template, the instruction, then the poem's first lines: the shared prefix
        assert t.text.startswith(template_head + sonnet.INSTRUCTION + lines[0] + lines[1])
        assert t.prompt_len == len(tok.encode(t.text)) <= 300
    assert len({t.text for t in ts}) == 6                        # the drawn lines differ
    chat = turns(build(DatasetOptions(**{**vars(opts), "chat": True}), tok))
    assert all(t.text.startswith(sonnet.INSTRUCTION + lines[0]) for t in chat)
    assert [chat_rendered(tok, t.text) for t in chat] == [t.text for t in ts]   # same draws


def test_sonnet_input_len_must_exceed_the_instruction(tok):
    with pytest.raises(DatasetError, match="--sonnet-input-len must exceed"):
        build(DatasetOptions(name="sonnet", sonnet_input_len=5), tok)


def test_synthetic_datasets_refuse_a_path(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("x\n")
    with pytest.raises(DatasetError, match="reads no --dataset-path"):
        DatasetOptions(name="random", dataset_path=str(path))
