"""engine/cpus.py: CPU lists, the host's cores, splitting them among nodes, binding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.cpus import CpuPlace, bind, format_cpulist, host_places, parse_cpulist, split


@pytest.mark.parametrize("text,cpus", [
    ("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,4,6-7", {0, 1, 4, 6, 7}), (" 2 , 0 ", {0, 2}),
    ("3,3,1-3", {1, 2, 3}),
])
def test_cpu_lists_parse_as_the_kernel_writes_them(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["", ",", "a", "0-", "-1", "3-1", "0-3,x", "1.5", "0--2", "99999999"])
def test_a_bad_cpu_list_is_a_value_error_naming_it(text):
    with pytest.raises(ValueError, match="cpus"):
        parse_cpulist(text)


def test_cpu_lists_format_with_runs_joined():
    assert format_cpulist([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpulist([5]) == "5"
    assert format_cpulist([]) == ""
    for text in ("0-3,8,10-11", "7", "0,2,4"):
        assert format_cpulist(parse_cpulist(text)) == text


def test_the_engine_config_refuses_a_bad_cpu_list():
    assert EngineConfig(cpus="0-1").cpus == "0-1"
    with pytest.raises(ValueError, match="not a CPU list"):
        EngineConfig(cpus="first-two")


def places(numa_nodes: int, cores: int, smt: int) -> dict[int, CpuPlace]:
    """A host the way Linux numbers it: CPU c is core c % cores' sibling c // cores
    (siblings after all first threads), cores spread evenly over NUMA nodes, a
    package (socket) each."""
    per_numa = cores // numa_nodes
    return {t * cores + core: CpuPlace(core // per_numa, core // per_numa, core)
            for t in range(smt) for core in range(cores)}


def test_two_nodes_on_a_two_socket_host_get_a_socket_each_siblings_together():
    host = places(numa_nodes=2, cores=8, smt=2)      # CPUs 0-15 first threads
    a, b = split(host, 2, host)
    assert a == parse_cpulist("0-3,8-11") and b == parse_cpulist("4-7,12-15")
    assert {host[c].numa for c in a} == {0} and {host[c].numa for c in b} == {1}


def test_uneven_splits_give_the_first_nodes_a_core_more_and_never_cut_a_core():
    host = places(numa_nodes=1, cores=5, smt=2)
    sets = split(host, 3, host)
    assert [len(s) for s in sets] == [4, 4, 2]
    assert frozenset().union(*sets) == frozenset(host) and sum(map(len, sets)) == len(host)
    for s in sets:                                                        # whole cores
        assert all((c + 5) % 10 in s for c in s)


def test_fewer_cores_than_nodes_is_no_split():
    host = places(numa_nodes=1, cores=1, smt=2)      # two SMT siblings
    assert split(host, 2, host) is None
    assert split(host, 1, host) == [frozenset({0, 1})]


def test_numa_splits_give_whole_nodes_or_none():
    host = places(numa_nodes=3, cores=6, smt=2)                          # 2 cores (4 CPUs) a NUMA node
    a, b = split(host, 2, host, by="numa")
    assert {host[c].numa for c in a} == {0, 1} and {host[c].numa for c in b} == {2}
    assert len(a) == 8 and len(b) == 4
    assert split(host, 4, host, by="numa") is None
    with pytest.raises(ValueError):
        split(host, 2, host, by="socket")


def test_a_subset_of_the_cpus_is_split_by_its_own_cores():
    host = places(numa_nodes=2, cores=8, smt=1)
    assert split([1, 2, 5, 6], 2, host) == [frozenset({1, 2}), frozenset({5, 6})]


def test_this_hosts_places_cover_every_cpu_it_may_use():
    cpus = os.sched_getaffinity(0)
    got = host_places(cpus)
    assert set(got) == cpus
    sets = split(cpus, 1, got)
    assert sets == [frozenset(cpus)]


def test_the_plan_for_kvd_serve_nodes_on_this_host():
    from kvd.local_cluster import node_cpu_sets

    mine = frozenset(os.sched_getaffinity(0))
    here = host_places(mine)
    assert node_cpu_sets(2, "", "off") is None and node_cpu_sets(1, "", "cores") is None
    cores = node_cpu_sets(2, "", "cores")
    if len(set(here.values())) >= 2:
        assert cores is not None and len(cores) == 2
        a, b = (parse_cpulist(c) for c in cores)
        assert a | b == mine and not a & b
    numa = node_cpu_sets(2, "", "numa")
    assert (numa is None) == (len({p.numa for p in here.values()}) < 2)
    assert node_cpu_sets(2, "", "auto") == cores                          # mixed nodes
    assert node_cpu_sets(2, "", "auto", disaggregated=True) == numa       # prefill + decode
    with pytest.raises(ValueError, match="not among those this process may use"):
        node_cpu_sets(2, f"{max(mine) + 1}", "cores")
    with pytest.raises(ValueError, match="not a CPU list"):
        node_cpu_sets(2, "0-", "off")


BIND_CHILD = r"""
import os, sys, threading
from engine.cpus import bind
early = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
early.start()                                   # a thread from before the bind moves too
try:
    bind(sys.argv[1])
except ValueError as exc:
    print("refused", exc, os.sched_getaffinity(0) == set(map(int, sys.argv[2].split(","))))
    sys.exit(0)
later = []
t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
import torch                                    # its OpenMP team is sized to the bound CPUs
tasks = {int(x): sorted(os.sched_getaffinity(int(x))) for x in os.listdir("/proc/self/task")}
print(sorted(os.sched_getaffinity(0)), later[0], sorted(set(map(tuple, tasks.values()))), torch.get_num_threads())
"""


def test_bind_moves_every_thread_and_sizes_torchs_team():
    cpus = sorted(os.sched_getaffinity(0))
    one = cpus[-1]
    out = subprocess.run([sys.executable, "-c", BIND_CHILD, str(one), ""], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{one}]", f"[{one}]", f"[({one},)]", "1"]


def test_bind_refuses_cpus_this_process_may_not_use_and_changes_nothing():
    cpus = sorted(os.sched_getaffinity(0))
    outside = max(cpus) + 1
    out = subprocess.run([sys.executable, "-c", BIND_CHILD, f"{cpus[0]},{outside}", ",".join(map(str, cpus))],
                         capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused") and out.stdout.rstrip().endswith("True")
    assert f"CPUs {outside} are not among those this process may use" in out.stdout
    with pytest.raises(ValueError, match="not a CPU list"):
        bind("zero")
