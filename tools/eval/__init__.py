"""Evaluation runs against ``kvd serve`` with lm-evaluation-harness.

- ``tasks/``      lm-eval task files: ``kvd_qa_gen`` (generation) and
                  ``kvd_qa_mc`` (loglikelihood), on ``data/qa.jsonl``
- ``tokenizer``   writes a served model's tokenizer as a Hugging Face
                  tokenizer directory, for lm-eval's ``local-completions``
                  loglikelihood requests, which need one and must not download it

The commands are in docs/serving.md ("Evaluation with lm-evaluation-harness").
"""
