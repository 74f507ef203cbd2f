"""Instance pairs in the config (``[cluster].pairs``, ``[nodes.NAME].pair``,
``kvd node --pair``; docs/cluster.md, "Pairs and roles"): who is paired with
whom, validated. Imports no torch.
"""

from __future__ import annotations

from dataclasses import replace

from kvd.cluster_config import ClusterConfig, ConfigError, Role


def pair_map(cfg: ClusterConfig) -> dict[str, str]:
    """node -> partner, both ways, from ``[cluster].pairs`` (the ``[nodes]``
    tables in order) or the ``[nodes.NAME].pair`` keys. Raises ConfigError
    for a pair naming a node without a table, a node paired with itself or
    twice, a pair whose nodes name different partners, an odd number of
    tables with ``pairs``, both ways of pairing at once, and a paired node
    whose role cannot decode (its partner hands it decodes)."""
    named = {n.name: n.pair for n in cfg.nodes.values() if n.pair}
    if cfg.pairs and named:
        raise ConfigError("cluster.pairs pairs the [nodes] tables in order; drop the nodes.NAME.pair keys "
                          "or cluster.pairs")
    out: dict[str, str] = {}
    if cfg.pairs:
        names = list(cfg.nodes)
        if len(names) % 2:
            raise ConfigError(f"cluster.pairs needs an even number of [nodes] tables, got {len(names)}")
        for a, b in zip(names[::2], names[1::2]):
            out[a], out[b] = b, a
    for name, partner in named.items():
        where = f"nodes.{name}.pair"
        if partner == name:
            raise ConfigError(f"{where}: a node cannot be paired with itself")
        if partner not in cfg.nodes:
            raise ConfigError(f"{where} names {partner!r}, which has no [nodes.{partner}] table")
        if named.get(partner, name) != name:
            raise ConfigError(f"{where} is {partner!r}, but nodes.{partner}.pair is {named[partner]!r}")
        if out.get(partner, name) != name:
            raise ConfigError(f"node {partner!r} is paired twice (with {out[partner]!r} and {name!r})")
        out[name], out[partner] = partner, name
    for name in out:
        if cfg.node(name).role == Role.PREFILL:
            raise ConfigError(f"nodes.{name}.role is prefill, but a paired node must decode (mixed or decode)")
    return out


def with_pair(cfg: ClusterConfig, name: str, partner: str) -> ClusterConfig:
    """``cfg`` with ``name`` paired with ``partner`` (``kvd node --pair``): both
    get a ``[nodes]`` table naming the other; validated as the file's are."""
    if cfg.pairs:
        cfg = replace(cfg, pairs=False, nodes=dict(cfg.nodes))
    nodes = dict(cfg.nodes)
    nodes[name] = replace(cfg.node(name), pair=partner)
    nodes[partner] = replace(cfg.node(partner), pair=name)
    return replace(cfg, nodes=nodes)
