"""kvd's benchmarks (docs/benchmarks.md): ``python -m tools.bench.AREA.NAME``.

Importing the package makes SIGTERM (``timeout``, ``kill``) end a benchmark through its
``finally`` blocks, so the daemons it started are stopped with it
(``tools._twoproc.stop_on_sigterm``)."""

from tools._twoproc import stop_on_sigterm

stop_on_sigterm()
