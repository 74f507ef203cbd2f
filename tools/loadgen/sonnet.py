"""vLLM's ``sonnet`` dataset: prompts of poem lines with a shared opening.

Each prompt is an instruction, the first lines of the poem text (the shared
prefix, about ``sonnet_prefix_len`` tokens with the instruction) and lines
drawn at random with replacement, enough for about ``sonnet_input_len``
tokens once rendered through the model's chat template.  A drawn prompt
longer than ``sonnet_input_len`` is drawn again, as in vLLM.  On
``/v1/completions`` the rendered prompt is sent; on the chat endpoint the
user text, which the server renders.

vLLM reads ``benchmarks/sonnet.txt`` from its own tree; kvd bundles its own
public-domain text (``data/sonnets.txt``: eighteen of Shakespeare's sonnets,
one line of verse a line) and uses it when no ``--dataset-path`` is given.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.loadgen.datasets import (Conversation, DatasetError, DatasetOptions, Tokenizer, Turn,
                                    chat_rendered)

BUNDLED_TEXT = Path(__file__).parent / "data" / "sonnets.txt"
INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"
DRAWS_PER_PROMPT = 100   # a bound on redraws of too-long prompts: every loop ends


def read_lines(path: str | Path) -> list[str]:
    """The text's non-empty lines, each with its newline."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read sonnet text {path}: {exc}") from None
    lines = [line + "\n" for line in text.splitlines() if line.strip()]
    if not lines:
        raise DatasetError(f"{path}: no lines of text")
    return lines


def build(opts: DatasetOptions, tok: Tokenizer, rng: np.random.Generator) -> list[Conversation]:
    """``opts.num_prompts`` sonnet prompts (see the module docstring)."""
    lines = read_lines(opts.dataset_path or BUNDLED_TEXT)
    avg_len = sum(len(tok.encode(line)) for line in lines) / len(lines)
    base_len = len(tok.encode(chat_rendered(tok, INSTRUCTION)))
    if opts.sonnet_input_len <= base_len:
        raise DatasetError(f"--sonnet-input-len must exceed the instruction's {base_len} tokens, "
                           f"got {opts.sonnet_input_len}")
    num_input_lines = round((opts.sonnet_input_len - base_len) / avg_len)
    num_prefix_lines = max(round((opts.sonnet_prefix_len - base_len) / avg_len), 0)
    prefix = "".join(lines[:num_prefix_lines])
    extra = max(num_input_lines - num_prefix_lines, 0)

    out: list[Conversation] = []
    for _ in range(opts.num_prompts * DRAWS_PER_PROMPT):
        picks = rng.integers(0, len(lines), size=extra).tolist()
        text = INSTRUCTION + prefix + "".join(lines[i] for i in picks)
        rendered = chat_rendered(tok, text)
        prompt_len = len(tok.encode(rendered))
        if prompt_len > opts.sonnet_input_len:
            continue
        if opts.chat:       # the length the dataset reports is the text's it sends
            out.append(Conversation((Turn(text, len(tok.encode(text)), opts.sonnet_output_len),)))
        else:
            out.append(Conversation((Turn(rendered, prompt_len, opts.sonnet_output_len),)))
        if len(out) == opts.num_prompts:
            return out
    raise DatasetError(f"no sonnet prompt of at most --sonnet-input-len {opts.sonnet_input_len} "
                       f"tokens in {opts.num_prompts * DRAWS_PER_PROMPT} draws; raise it")
