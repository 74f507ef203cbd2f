"""Faults in the simulator: a node killed at a given time, and what the
coordinator does about its requests.

``kvd simulate --fail NODE@SECONDS[:MODE]`` (kvd-loadgen's flag, parsed by
its ``FaultSpec``; ``exit`` and ``stop`` alike: the node computes nothing
more) kills NODE that many simulated seconds into the run: the step it was
running is lost, work sent to it meanwhile is lost with it, and it stays
counted where it was sent. The coordinator notices one
``[cluster].heartbeat_deadline`` after the node's last heartbeat (they come
every ``heartbeat_interval``), then, as kvd/coordinator/failover.py does:

- the node leaves the routable set and the prompt trees (``CacheSync.gone``);
- every request counted on it is moved by kvd's own ``RecoveryPolicy``
  (``recovery``, ``max_recoveries``, ``replicas``): ``target`` chooses the
  holder of its replica when ``recovery = "replica"`` and one is usable
  (the dead node's pair partner, which holds a copy of every token the
  node computed; else its ring peer, ``ring_peers``, as of the death: with
  ``replicas = 1`` it holds every token the node decoded), else the router's
  pick among the live nodes; ``fail`` (or no node left, or
  ``max_recoveries`` spent) ends it with an error;
- the resumed request reaches its node one hop later and runs as the
  engine's ``resume_request`` runs it: prompt and tokens so far, computed
  over whatever that node caches. A replica's KV is committed into the
  holder's prefix cache first, in the host tier where replicas live, so the
  resume costs the profile's swap-in of those blocks and a prefill of the
  tail (a pair partner's copy: in its device tier, no swap-in); a
  re-prefill computes everything (the profile's prefill costs).
- a decode node whose prefill node died computes the prompt itself
  (``kv_load_failure = "recompute"``); the prefill leg of a request whose
  decode node died is aborted.

Not modelled: a replica lagging its source by one replication round, and
a node coming back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.request import Request, SamplingParams
from kvd.coordinator.recovery import RecoveryPolicy
from kvd.sim.node import token_of

if TYPE_CHECKING:
    from kvd.sim.cluster import SimCluster, SimStream

INCARNATION = "1"                   # a simulated node never restarts


class SimFailover:
    """Kills nodes at their times and recovers their requests (module docstring)."""

    def __init__(self, sim: "SimCluster") -> None:
        c = sim.cluster
        self.sim = sim
        self.policy = RecoveryPolicy(policy=c.recovery, max_recoveries=c.max_recoveries, replicas=c.replicas)
        self.faults: list[dict] = []      # kvd-loadgen's fault events, for the result
        self.moves: list[tuple[str, str, str, int]] = []   # (request, dead node, new node, replicated tokens)

    def schedule(self, specs) -> None:
        """Kill each ``FaultSpec``'s node at its time; raises ValueError naming
        a node the cluster does not have."""
        for spec in specs:
            if spec.node not in self.sim.nodes:
                raise ValueError(f"--fail {spec.node}@{spec.at_s:g}: the simulated cluster's nodes are "
                                 f"n1..n{len(self.sim.nodes)}")
        for spec in specs:
            event = {"node": spec.node, "mode": spec.mode, "at_s": spec.at_s, "sent_s": None, "ok": False,
                     "reply": None, "error": None}
            self.faults.append(event)
            self.sim.events.at(spec.at_s, self.kill, event)

    def kill(self, event: dict) -> None:
        sim, name = self.sim, event["node"]
        node = sim.nodes[name]
        event["sent_s"] = sim.events.now
        if node.dead:
            event["error"] = f"node {name} is dead already"
            return
        event["ok"], event["reply"] = True, {"ok": True}
        holder = self.policy.peer_of(name, sim.infos.values())      # a pair partner, or the ring peer
        node.kill()
        interval, deadline = sim.cluster.heartbeat_interval, sim.cluster.heartbeat_deadline
        last_beat = sim.events.now - sim.events.now % interval
        sim.events.at(max(sim.events.now, last_beat + deadline), self.declare_dead, name,
                      holder.name if holder is not None else None)

    def declare_dead(self, name: str, holder: str | None) -> None:
        sim = self.sim
        info = sim.infos.pop(name)
        sim.forget_routable()
        sim.cache_sync.gone(name)
        rids = sorted(info.in_flight)
        if holder is not None:
            # what the holder's heartbeat reported: every token the dead node decoded
            self.policy.table.update(holder, {name: {rid: s.tokens for rid in rids
                                                     if (s := sim.streams.get(rid)) is not None and s.tokens}})
        for rid in rids:
            stream = sim.streams.get(rid)
            if stream is not None:
                self.recover(stream, name)
        self.policy.table.forget(name)

    def recover(self, stream: "SimStream", dead: str) -> None:
        sim, rid = self.sim, stream.request_id
        sim.load.uncount(rid, dead)
        if stream.decode is not None:                       # its prefill leg had not handed off
            decode, req, region = stream.decode
            stream.decode = None
            if dead == stream.prefill_node:                 # the decode node computes the prompt itself
                stream.prefill_node = ""
                if not decode.dead:
                    region.cancel()
                    sim.add_to(decode, req, stream)
                return
            prefill = sim.nodes[stream.prefill_node]
            if stream.leg is not None and not prefill.dead:
                prefill.abort(stream.leg)
            sim.load.uncount(rid, prefill.name)
            stream.prefill_node, stream.leg = "", None
        if dead != stream.node:
            return
        stream.failed.add((dead, INCARNATION))
        stream.moving = False                               # a pair's handoff to or from it ended with it
        how = "reprefill"
        while self.policy.policy != "fail" and stream.recoveries < self.policy.max_recoveries:
            stream.recoveries += 1
            candidates, _ = sim.routable()
            choice = self.policy.target(rid, dead, stream.failed, candidates,
                                        lambda nodes: sim.router.pick(nodes, stream.prompt, rid))
            if choice is None:
                break
            node, tokens = choice
            how = "replica" if tokens else "reprefill"
            self.policy.outcomes[(how, "resumed")] += 1
            stream.node = node.name
            self.moves.append((rid, dead, node.name, tokens))
            sim.load.count(rid, node)
            node.routed += 1
            # a pair partner's copy sits in its device tier, a ring peer's replica in the host tier
            tier = "device" if self.policy.pairs.announced.get(dead) == node.name else "host"
            sim.events.after(sim.hop, self._resume, stream, node.name, tokens, tier)
            return
        self.policy.outcomes[(how if self.policy.policy != "fail" else "fail", "failed")] += 1
        sim.end(stream, f"node {dead} died; not recovered ({self.policy.policy})")

    def _resume(self, stream: "SimStream", name: str, replicated: int, tier: str = "host") -> None:
        """The ResumeRequest reaches ``name``: prompt and tokens so far."""
        sim, rid = self.sim, stream.request_id
        node = sim.nodes[name]
        if node.dead:
            return                                          # lost with it: recovered when it is declared dead
        outputs = [token_of(rid, i) for i in range(stream.tokens)]
        if replicated:
            node.hold_replica(stream.prompt + outputs[:-1], tier)
        params = SamplingParams(max_tokens=stream.max_tokens, temperature=0.0, ignore_eos=True)
        req = Request(request_id=rid, prompt_ids=list(stream.prompt), params=params, arrival=sim.events.now)
        req.output_ids = outputs
        sim.add_to(node, req, stream)

    def describe(self) -> dict:
        return {f"{how}_{outcome}": n for (how, outcome), n in sorted(self.policy.outcomes.items())}
