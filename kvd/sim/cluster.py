"""A simulated cluster: the coordinator's routing over simulated nodes.

The coordinator's decisions are kvd's own objects, not copies:

- the router (``make_router``: prompt-tree, session or least-load, with the
  cluster's ``CostWeights``) and a second one for prefill legs, as the
  coordinator daemon builds them, reading simulated time (their ``clock``);
- the global prompt trees, fed by each node's MemPool cache events through
  ``cache_events.pack`` and ``CacheSync`` (the wire path, minus the wire);
- the load book (``LoadBook``) and the prefill-queue bound
  (``LegSender._pick_prefill``, whose queue reads this module's streams).

What the daemons do in between is modelled: a request waits the profile's
serving overhead before it is routed (its HTTP parsing, tokenizing and
event-loop hops, measured through a real ``kvd serve``); a message between
processes takes half the profile's small-message round trip (``hop``); a disaggregated
request's decode node reserves the prompt's blocks (``SimNode.reserve_prompt``,
the node's own threshold rule), its prefill leg reaches the prefill node the
profile's ``serving.disagg_s`` after the grant (what that path costs beyond
its hops, measured through a real 1P1D), runs there and
hands off after the first token, and the prompt's KV reaches the decode node
one transfer later (per layer, overlapped with the prefill, with
``kv_stream = "layers"``: the last layer's share; else the whole prompt's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.request import Request, SamplingParams
from kvd import cache_events
from kvd.cluster_config import ClusterConfig, Role
from kvd.coordinator.cache_router import CostWeights, make_router
from kvd.coordinator.cache_sync import CacheSync
from kvd.coordinator.legs import LegSender
from kvd.coordinator.load import LoadBook
from kvd.coordinator.membership import NodeInfo
from kvd.coordinator.prompt_tree import PromptTrees
from kvd.sim.events import EventQueue
from kvd.sim.faults import SimFailover
from kvd.sim.host import SimHost
from kvd.sim.node import HAND_OFF, SimNode
from kvd.sim.profile_file import Profile


@dataclass
class SimStream:
    """The coordinator's view of one request (the fields ``LegSender`` reads:
    ``tokens``, ``prompt_len``) and what its client saw, in simulated seconds."""

    request_id: str
    prompt_len: int
    max_tokens: int
    sent_at: float
    on_done: Callable[["SimStream"], None]
    tokens: int = 0
    arrivals: list[float] = field(default_factory=list)
    error: str = ""
    prefill_node: str = ""
    decode: tuple | None = None        # (decode SimNode, its Request, the Region) until its prefill leg hands off
    node: str = ""                     # the node that runs it (decodes it, with a prefill leg)
    prompt: list[int] = field(default_factory=list)
    leg: Request | None = None         # its prefill leg on the prefill node, until it hands off
    recoveries: int = 0
    failed: set[tuple[str, str]] = field(default_factory=set)   # (name, incarnation) that lost it
    made_here: int = 0                 # tokens its node made (a pair: its copy is complete after one)
    moving: bool = False               # a pair's handoff of it is under way


class SimCluster:
    def __init__(self, engine: EngineConfig, cluster: ClusterConfig, roles: list[str], profile: Profile,
                 events: EventQueue, *, colocated: bool = False, host_cores: int = 0,
                 keep_log: bool = False) -> None:
        """``colocated``: every node runs on one host and shares its last-level
        cache (``kvd serve --nodes N`` on one machine), and its ``host_cores``
        (0: as many as the nodes' threads); else one host per node."""
        self.engine, self.cluster, self.profile, self.events = engine, cluster, profile, events
        self.hop = profile.costs.transfer_latency_s / 2
        self.block_size = engine.block_size
        self.trees = PromptTrees(block_size=engine.block_size, pending_ttl=cluster.routing_pending_ttl)
        self.cache_sync = CacheSync(self.trees)
        weights = CostWeights(cluster.routing_overlap_weight, cluster.routing_load_weight,
                              cluster.routing_max_imbalance, cluster.routing_recent_weight,
                              cluster.routing_load_decay)
        self.router = make_router(cluster.routing, self.trees, affinity_tokens=cluster.affinity_tokens,
                                  weights=weights)
        self.prefill_router = make_router(cluster.routing, self.trees, affinity_tokens=cluster.affinity_tokens,
                                          weights=weights)
        for r in (self.router, self.prefill_router):
            r.clock = events.clock
        self.load = LoadBook()
        self.streams: dict[str, SimStream] = {}
        self.legs = LegSender(None, None, self.load, self.streams, None, self.router, self.prefill_router,
                              kv_return=False, kv_return_timeout=0.0,
                              prefill_queue_factor=cluster.prefill_queue_factor)
        self.nodes: dict[str, SimNode] = {}
        self.infos: dict[str, NodeInfo] = {}
        self._seq: dict[str, int] = {}
        self._routable: tuple[list[NodeInfo], list[NodeInfo]] | None = None
        self.failover = SimFailover(self)
        self.route_seconds = 0.0           # wall time spent in router picks
        self.routed = 0
        for i, role in enumerate(roles):
            name = f"n{i + 1}"
            self.nodes[name] = SimNode(name, role, engine, profile.costs, events, self._on_token, self._on_events,
                                       kv_bytes_per_token=profile.kv_bytes_per_token,
                                       replicas=cluster.replicas, token_s=profile.serving_token_s,
                                       cache=profile.cache, wake=profile.wake, threads=profile.threads, keep_log=keep_log,
                                       kv_messages=profile.num_layers if cluster.kv_stream == "layers" else 1)
            self.infos[name] = NodeInfo(name=name, address=f"sim://{name}", incarnation="1",
                                        model_name=profile.model, max_model_len=1 << 20,
                                        block_size=engine.block_size,
                                        blocks_per_tier={"device": engine.kv_blocks, "host": engine.host_kv_blocks},
                                        last_seen=0.0, role=role)
            self.cache_sync.registered(name, engine.block_size, role)
            self.cache_sync.handle(cache_events.pack(name, 0, engine.block_size, [], snapshot=True))
            self._seq[name] = 0
        if colocated:
            host = SimHost(host_cores, events) if host_cores else None
            for node in self.nodes.values():
                node.neighbours = [n for n in self.nodes.values() if n is not node]
                node.host = host
            if host is not None:
                host.nodes = list(self.nodes.values())
        self.pairs = None
        if cluster.pairs:
            from kvd.sim.pairs import SimPairs

            self.pairs = SimPairs(self)
            self.failover.policy.pairs = self.pairs.book

    # ------------------------------------------------------------------ routing
    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int,
               on_done: Callable[[SimStream], None]) -> SimStream:
        """A client sends a request now; it reaches the coordinator one hop and
        the profile's serving overhead (HTTP, tokenizing: tools/sim/measure.py) later."""
        stream = SimStream(request_id, len(prompt_ids), max_tokens, self.events.now, on_done)
        self.events.after(self.hop + self.profile.serving_s, self._route, stream, list(prompt_ids))
        return stream

    def _route(self, stream: SimStream, prompt: list[int]) -> None:
        """LegSender.submit's choice: a node for the request (never a prefill node
        while another is routable), and a prefill node for a decode node's request."""
        t0 = time.perf_counter()
        rid = stream.request_id
        candidates, whole = self.routable()
        node = self.router.pick(whole, prompt, rid)
        if node is None:                   # every node died: the front door refuses it
            self.route_seconds += time.perf_counter() - t0
            self.events.after(self.hop, self._refuse, stream)
            return
        prefill = self.legs._pick_prefill(candidates, prompt, rid) if node.role == Role.DECODE else None
        self.route_seconds += time.perf_counter() - t0
        self.routed += 1
        if prefill is not None:
            self.load.count(rid, prefill)
        self.streams[rid] = stream
        stream.node, stream.prompt = node.name, prompt
        self.load.count(rid, node)
        node.routed += 1
        self.events.after(self.hop, self._arrive, stream, prompt, self.nodes[node.name],
                          self.nodes[prefill.name] if prefill is not None else None)

    def _refuse(self, stream: SimStream) -> None:
        stream.error = "no node is routable"
        stream.on_done(stream)

    def routable(self) -> tuple[list[NodeInfo], list[NodeInfo]]:
        """The routable nodes, and those a whole request may go to (never a
        prefill node while another is routable): the same lists until a
        node joins or leaves (the router keys its per-node arrays on them)."""
        if self._routable is None:
            candidates = list(self.infos.values())
            self._routable = (candidates, [n for n in candidates if n.role != Role.PREFILL] or candidates)
        return self._routable

    def forget_routable(self) -> None:
        """A node left: ``routable`` builds its lists again."""
        self._routable = None

    def _arrive(self, stream: SimStream, prompt: list[int], node: SimNode, prefill: SimNode | None) -> None:
        if node.dead:
            return                         # lost with the node: recovered once it is declared dead
        params = SamplingParams(max_tokens=stream.max_tokens, temperature=0.0, ignore_eos=True)
        req = Request(request_id=stream.request_id, prompt_ids=prompt, params=params, arrival=self.events.now)
        if prefill is not None:
            region, _ = node.reserve_prompt(prompt, self.cluster.prefill_threshold)
            if region is not None:
                stream.prefill_node = prefill.name
                stream.decode = (node, req, region)
                # the grant goes back to the coordinator, the prefill leg on to the prefill node
                self.events.after(2 * self.hop + self.profile.serving_disagg_s, self._prefill_leg, stream, prompt,
                                  prefill)
                return
            self.load.uncount(stream.request_id, prefill.name)
        self.add_to(node, req, stream)

    def _prefill_leg(self, stream: SimStream, prompt: list[int], prefill: SimNode) -> None:
        params = SamplingParams(max_tokens=stream.max_tokens, temperature=0.0, ignore_eos=True)
        req = Request(request_id=stream.request_id, prompt_ids=prompt, params=params, arrival=self.events.now)
        req.kv_out = HAND_OFF
        if not prefill.dead:
            stream.leg = req
            self.add_to(prefill, req, stream)

    def add_to(self, node: SimNode, req: Request, stream: SimStream) -> None:
        try:
            node.add(req)
        except ValueError as exc:
            self.end(stream, f"refused by {node.name}: {exc}")

    # ------------------------------------------------------------------ outputs
    def _on_token(self, node: SimNode, req: Request, done: bool, handed: bool, new: bool = True) -> None:
        stream = self.streams.get(req.request_id)
        if stream is None:
            return
        if new:
            stream.tokens += 1
            stream.made_here += 1
            stream.arrivals.append(self.events.now + self.hop)      # reaches the client one hop later
        if handed:
            self.load.uncount(stream.request_id, node.name)
            decode, dreq, region = stream.decode
            stream.decode, stream.leg = None, None
            nbytes = region.blocks * self.block_size * self.profile.kv_bytes_per_token
            if self.cluster.kv_stream == "layers":
                nbytes //= max(1, self.profile.num_layers)       # the rest streamed during the prefill
            self.events.after(self.profile.costs.transfer_seconds(nbytes), decode.add_prefilled,
                              dreq, region, req.output_ids[0])
        elif done:
            self.events.after(self.hop, self.end, stream, "")

    def end(self, stream: SimStream, error: str) -> None:
        stream.error = error
        self.load.release(stream.request_id)
        self.streams.pop(stream.request_id, None)
        stream.on_done(stream)

    def _on_events(self, node: SimNode, events: list) -> None:
        msg = cache_events.pack(node.name, self._seq[node.name], self.block_size, events)
        self._seq[node.name] += len(events)
        self.events.after(self.hop, self.cache_sync.handle, msg)

    # ------------------------------------------------------------------ queries
    def describe(self) -> dict:
        busy = {n: round(s.busy_seconds, 3) for n, s in self.nodes.items()}
        return {"nodes": len(self.nodes), "roles": [s.role for s in self.nodes.values()],
                "steps": sum(s.steps for s in self.nodes.values()), "busy_seconds": busy,
                "routed": self.routed,
                "route_us_per_decision": round(1e6 * self.route_seconds / max(1, self.routed), 2),
                "prefill_queue_bypassed": self.legs.prefill_queue_bypassed,
                "recovery": self.failover.describe(),
                "cache_events_applied": self.cache_sync.applied_events,
                **({"pairs": self.pairs.describe()} if self.pairs is not None else {})}
