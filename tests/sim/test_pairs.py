"""Instance pairs in the simulator (kvd/sim/pairs.py): kvd's PairRouter and
plan_moves over simulated nodes that run the engine's PrefillAlone rule;
handoffs without a prefill, a partner's copy after a death, and the shapes
refused."""

from __future__ import annotations

import random

import pytest

from kvd.sim.cluster import SimCluster
from kvd.sim.events import EventQueue
from tools.kvd_command import main
from tools.sim.run import SimUsageError, load_shape


def cluster_of(profile, nodes: int = 2, pairs: bool = True, config=None) -> tuple[SimCluster, EventQueue]:
    shape = load_shape(str(config) if config else None, str(profile), nodes, 0, "least-load", False, None, pairs)
    events = EventQueue()
    return SimCluster(shape.engine, shape.cluster, list(shape.roles), shape.profile, events, keep_log=True), events


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


def run(sim: SimCluster, events: EventQueue, arrivals) -> dict:
    """``arrivals``: (time, id, prompt tokens, max_tokens); the finished streams by id."""
    done = {}
    for t, rid, n, max_tokens in arrivals:
        events.at(t, sim.submit, rid, prompt(n, hash(rid) % 1000), max_tokens, lambda s: done.setdefault(s.request_id, s))
    events.run()
    return done


CHATS_THEN_A_PROMPT = [(0.0, "a", 32, 120), (0.02, "b", 32, 120), (0.15, "c", 900, 4)]


def test_a_prompts_node_hands_its_decodes_to_the_partner_and_prefills_alone(write_profile):
    sim, events = cluster_of(write_profile(threads=1))
    done = run(sim, events, CHATS_THEN_A_PROMPT)
    assert {rid: (s.error, s.tokens) for rid, s in done.items()} == {"a": ("", 120), "b": ("", 120), "c": ("", 4)}
    assert sim.pairs.describe()["handoffs"] >= 1
    for node in sim.nodes.values():          # no step ran a prompt's chunk beside a decode
        assert not [s for s in node.log if s.prefill and s.decode], node.name
    c_node = next(n for n in sim.nodes.values() if any(rid == "sim-c" or rid == "c" for s in n.log for rid, _ in s.prefill))
    other = next(n for n in sim.nodes.values() if n is not c_node)
    c_steps = [s for s in c_node.log if any(rid == "c" for rid, _ in s.prefill)]
    # while c's prompt was computed, its partner decoded both chats
    assert any(set(s.decode) == {"a", "b"} and c_steps[0].start <= s.start <= c_steps[-1].start for s in other.log)


def test_a_handed_off_request_resumes_from_the_copy_without_a_prefill(write_profile):
    sim, events = cluster_of(write_profile(threads=1))
    run(sim, events, CHATS_THEN_A_PROMPT)
    for node in sim.nodes.values():
        chats = [(rid, n) for s in node.log for rid, n in s.prefill if rid in ("a", "b")]
        assert all(n == 32 for _, n in chats), chats          # each chat's prompt computed once, where it began
    assert sum(1 for node in sim.nodes.values() for s in node.log for rid, _ in s.prefill if rid in ("a", "b")) == 2


def test_unpaired_nodes_mix_prefill_and_decode_and_move_nothing(write_profile):
    sim, events = cluster_of(write_profile(threads=1), pairs=False)
    done = run(sim, events, CHATS_THEN_A_PROMPT)
    assert all(s.tokens == s.max_tokens and not s.error for s in done.values())
    assert sim.pairs is None
    assert any(s.prefill and s.decode for node in sim.nodes.values() for s in node.log)   # chunked prefill


def test_a_paired_steps_copies_cost_cpu_on_both_nodes(write_profile):
    from types import SimpleNamespace

    paired, _ = cluster_of(write_profile(threads=1))
    n1, n2 = paired.nodes["n1"], paired.nodes["n2"]
    c = paired.profile.costs
    batch = SimpleNamespace(prefill=[], prefill_lens=[], decode=[SimpleNamespace(num_computed=40)] * 3,
                            preempted=[], host_blocks_swapped_in=0)
    before = n2.received_s
    with_copies = n1.step_seconds(batch)
    n1.partner = None
    without = n1.step_seconds(batch)
    assert with_copies - without == pytest.approx(c.transfer_byte_s * n1.kv_bytes_per_token * 3
                                                  + c.transfer_latency_s / 2)
    assert n2.received_s - before == pytest.approx(with_copies - without)     # the partner pays to receive


def test_a_dead_members_streams_resume_on_the_partner_from_its_copy(write_profile, tmp_path):
    from tools.loadgen.faults import FaultSpec

    config = tmp_path / "kvd.toml"
    config.write_text('[cluster]\nrecovery = "replica"\n')
    sim, events = cluster_of(write_profile(threads=1), config=config)
    sim.failover.schedule([FaultSpec(node="n1", at_s=0.3, mode="exit")])
    done = run(sim, events, [(0.0, "a", 64, 200), (0.02, "b", 64, 200)])
    assert {rid: (s.error, s.tokens) for rid, s in done.items()} == {"a": ("", 200), "b": ("", 200)}
    moved = [m for m in sim.failover.moves if m[1] == "n1"]
    assert moved and all(to == "n2" and tokens > 0 for _, _, to, tokens in moved)
    # the resumed prompt's KV was a device-tier hit: the partner computed only the tail, no swap-in
    rid = moved[0][0]
    computed = [n for s in sim.nodes["n2"].log for r, n in s.prefill if r == rid]
    assert computed and computed[-1] < sim.engine.block_size + 1


@pytest.mark.parametrize("nodes,prefill", [(3, 0), (1, 0), (4, 1)])
def test_pairs_need_an_even_number_of_decoding_nodes(write_profile, nodes, prefill):
    with pytest.raises(SimUsageError, match="pairs need --nodes 2N"):
        load_shape(None, str(write_profile()), nodes, prefill, None, False, None, True)


def test_kvd_simulate_pairs_cli(write_profile, capsys):
    flags = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
             "--num-prompts", "6", "--request-rate", "4", "--seed", "0", "--tokenizer", "tiny"]
    profile = str(write_profile())
    assert main(["simulate", "--profile", profile, "--nodes", "2", "--pairs", *flags]) == 0
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--profile", profile, "--nodes", "3", "--pairs", *flags])
    assert exc.value.code == 2
    assert "pairs need --nodes 2N" in capsys.readouterr().err


def test_when_both_members_prefill_their_decodes_run_in_the_prompts_steps(write_profile):
    # a chat decoding on each node, then a long prompt to each: the coordinator moves nothing
    # while both prefill, so each node's rule gives its decode back to the prompt's chunk steps
    sim, events = cluster_of(write_profile(threads=1))
    done = run(sim, events, [(0.0, "a", 32, 150), (0.02, "b", 32, 150), (0.15, "c", 1200, 4), (0.15, "d", 1200, 4)])
    assert all(s.tokens == s.max_tokens and not s.error for s in done.values())
    prompt_s = sim.profile.costs.prefill_seconds([(1200, 0)])
    for rid in ("a", "b"):
        gaps = [y - x for x, y in zip(done[rid].arrivals, done[rid].arrivals[1:])]
        assert max(gaps) < prompt_s / 2, (rid, max(gaps), prompt_s)       # a token per chunk step, not one per prompt
    mixed = [s for n in sim.nodes.values() for s in n.log if s.prefill and s.decode]
    assert mixed and {d for s in mixed for d in s.decode} <= {"a", "b"}


def test_a_partner_without_room_for_the_copy_computes_the_request_again(write_profile):
    from engine.request import Request, RequestStatus, SamplingParams

    sim, _ = cluster_of(write_profile(threads=1))
    node = sim.nodes["n2"]
    req = Request(request_id="r", prompt_ids=prompt(64, 1), params=SamplingParams(max_tokens=20, temperature=0.0,
                                                                                    ignore_eos=True), arrival=0.0)
    req.output_ids = [5, 6, 7]
    free = node.pool.alloc_mem(node.pool.free_blocks("device"))      # the device tier full
    assert free is not None
    node.take_over(req)
    resumed = node.requests["r"]
    assert resumed.num_computed == 0 and resumed.status is RequestStatus.WAITING   # queued for a prefill
    assert resumed.output_ids == [5, 6, 7] and resumed is not req
    node.pool.free_mem(free)
    roomy, _ = cluster_of(write_profile("r.json", threads=1))
    roomy.nodes["n2"].take_over(req)
    assert roomy.nodes["n2"].requests["r"].num_computed == 64 + 2                # the copy: all but the last token
