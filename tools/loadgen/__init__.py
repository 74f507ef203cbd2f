"""kvd-loadgen: a load generator for OpenAI-compatible streaming servers.

Follows vLLM's ``bench serve`` conventions (flag names, metric definitions,
summary table) so numbers taken against kvd and against vLLM read the same.

Modules, in the order a run touches them:

- ``cli``      argparse; subcommands ``run`` (the default), ``plot``, ``compare``
- ``vllm_flags`` ``vllm bench serve`` spellings: backends, endpoints, flags refused by name
- ``datasets`` prompts measured in the served model's tokens
- ``sonnet``   vLLM's sonnet dataset over the bundled ``data/sonnets.txt``
- ``faults``   admin-socket client for ``--fail NODE@SECONDS``
- ``runner``   arrival process, concurrency limit, sessions, progress bar
- ``client``   one streamed request: SSE parsing and timestamps
- ``metrics``  pure functions from request records to TTFT/TPOT/ITL/E2EL/goodput
- ``report``   summary table and the JSON result file
- ``plot``     latency CDFs and throughput over time (PNG)
- ``fake_server`` a trivial SSE server for tests and the generator benchmark
"""

__version__ = "0.1.0"
