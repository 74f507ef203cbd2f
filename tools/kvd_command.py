"""The ``kvd`` command (pyproject's console script): kvd/cli.py's commands, and
``kvd profile``, ``kvd simulate`` and ``kvd plan`` (tools/sim/cli.py), which drive
kvd-loadgen's workloads and results and so sit in the layer above kvd's."""

from __future__ import annotations

from kvd import cli
from tools.sim.cli import add_sim_parsers, run_sim_command


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, add_commands=add_sim_parsers, run_command=run_sim_command)


if __name__ == "__main__":
    raise SystemExit(main())
