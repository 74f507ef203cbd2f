"""CPU sets for engines: Linux CPU lists, the host's cores, and splitting them among nodes.

``[engine].cpus`` (``--cpus``) names the CPUs a daemon's engine computes on, in the
kernel's list syntax (``0-7,16-23``; ``cpuset(7)``). ``bind`` moves every thread of the
process onto them before torch starts its OpenMP team, so the team is sized to them
(one thread per core) and each later thread inherits them.

``kvd serve --nodes N`` gives each node its own share (``[cluster].split_cpus``):
``split`` cuts the CPUs into N sets of whole NUMA nodes (two nodes on a two-socket
host: a socket each, its memory local to its threads) or of whole cores (SMT
siblings together), in order of NUMA node. Teams on CPUs of their own each spin on
theirs; teams that share CPUs spin against each other (docs/benchmarks.md). vLLM's
CPU backend binds its workers' OpenMP threads by NUMA node likewise
(``VLLM_CPU_OMP_THREADS_BIND``).

Torch-free: ``kvd serve --nodes N`` plans the split in a process that loads no model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_CPU = 1 << 16                   # a CPU number past this is a typo, not a CPU


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list (``"0-3,8"``). Raises ValueError on bad syntax, a
    descending range or an empty list."""
    cpus: set[int] = set()
    for part in text.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"cpus {text!r} is not a CPU list (e.g. \"0-3,8\"): bad part {part.strip()!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo or hi >= MAX_CPU:
            raise ValueError(f"cpus {text!r}: bad range {part.strip()!r}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """``cpus`` as a Linux CPU list, runs joined: {0, 1, 2, 3, 8} -> ``"0-3,8"``."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True, order=True)
class CpuPlace:
    """Where a CPU sits: its NUMA node, package (socket) and core; CPUs with the same
    three are SMT siblings of one core. Ordering sorts NUMA nodes apart."""

    numa: int
    package: int
    core: int


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def host_places(cpus: Iterable[int]) -> dict[int, CpuPlace]:
    """Each of ``cpus``' place, from sysfs; a value sysfs does not give is 0 (one NUMA
    node, one package), and a CPU whose core id is unknown counts as a core of its own."""
    numa_of: dict[int, int] = {}
    for node in sorted(SYS_NODE.glob("node[0-9]*")):
        try:
            for c in parse_cpulist((node / "cpulist").read_text().strip() or "0-0"):
                numa_of.setdefault(c, int(node.name[4:]))
        except (OSError, ValueError):
            continue
    places = {}
    for c in cpus:
        topo = SYS_CPU / f"cpu{c}" / "topology"
        core = _read_int(topo / "core_id", -1)
        places[c] = CpuPlace(numa_of.get(c, 0), _read_int(topo / "physical_package_id", 0),
                             core if core >= 0 else MAX_CPU + c)
    return places


def split(cpus: Iterable[int], parts: int, places: Mapping[int, CpuPlace],
          by: str = "core") -> list[frozenset[int]] | None:
    """``cpus`` cut into ``parts`` disjoint sets of whole units, ``by`` "core" (SMT
    siblings together) or "numa" (NUMA nodes), as equal in units as they can be (the
    first sets take one more), in order of NUMA node, package and core; None where
    there are fewer units than parts."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    if by not in ("core", "numa"):
        raise ValueError(f"split by 'core' or 'numa', not {by!r}")
    units: dict[CpuPlace | int, list[int]] = {}
    for c in sorted(cpus, key=lambda c: (places[c], c)):
        units.setdefault(places[c].numa if by == "numa" else places[c], []).append(c)
    ordered = list(units.values())          # in order of first CPU's place
    if len(ordered) < parts:
        return None
    base, extra = divmod(len(ordered), parts)
    out, at = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append(frozenset(c for unit in ordered[at:at + n] for c in unit))
        at += n
    return out


def allowed() -> frozenset[int]:
    """The CPUs this process may run on now."""
    return frozenset(os.sched_getaffinity(0))


def check_allowed(cpus: frozenset[int], text: str) -> None:
    """Raise ValueError unless every CPU of ``cpus`` (parsed from ``text``) is one this
    process may run on."""
    have = allowed()
    if not cpus <= have:
        raise ValueError(f"cpus {text!r}: CPUs {format_cpulist(cpus - have)} are not among those this "
                         f"process may use ({format_cpulist(have)})")


def bind(text: str) -> frozenset[int]:
    """Move every thread of this process onto the CPUs of the list ``text``; threads
    started later inherit them. Call it before torch is imported, whose OpenMP runtime
    sizes its team from the CPUs it may use when it loads. Returns the CPUs. Raises
    ValueError (nothing changed) on a bad list or one with CPUs this process may not use."""
    cpus = parse_cpulist(text)
    check_allowed(cpus, text)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:          # a thread that ended meanwhile
            pass
    return cpus


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo's first "model name", else the platform's), or None."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
