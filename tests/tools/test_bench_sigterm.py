"""A benchmark stopped with SIGTERM (``timeout``, ``kill``) stops the daemons it started:
importing ``tools.bench`` makes SIGTERM end the process through its ``finally`` blocks,
where the benchmarks call ``stop_processes``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import subprocess, sys, time
import tools.bench
from tools._twoproc import stop_processes
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
try:
    time.sleep(300)
finally:
    stop_processes([child], grace=5)
"""


def test_sigterm_runs_the_benchmarks_finally_and_stops_its_daemons():
    bench = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(bench.stdout.readline())
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the benchmark's child outlived it")
