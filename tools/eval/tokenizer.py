"""Write a kvd model's tokenizer as a Hugging Face tokenizer directory.

    python -m tools.eval.tokenizer MODEL DIR      (MODEL: smollm2, tiny, a .gguf, an HF dir)

lm-evaluation-harness's ``local-completions`` model counts a loglikelihood
request's context tokens with a tokenizer of its own (``tokenizer_backend=
huggingface``) and would download it from the hub by model name; pointed at
this directory (``tokenizer=DIR``) it loads the served model's own tokenizer
offline and counts exactly the tokens the server does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export(model: str, directory: str | Path) -> Path:
    """Write ``model``'s tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) to
    ``directory``; returns it.  Raises ValueError / FileNotFoundError for an unknown model."""
    from engine.model.registry import load_tokenizer

    return load_tokenizer(model).save(directory)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.eval.tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model spec, as kvd serve --model takes it")
    p.add_argument("directory", help="where to write the tokenizer files")
    args = p.parse_args(argv)
    try:
        print(export(args.model, args.directory))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
