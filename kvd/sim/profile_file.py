"""A machine profile on disk (``kvd profile`` writes it; ``kvd simulate``,
``kvd plan`` and ``[engine].profile`` read it). JSON, never pickled::

    {"kind": "kvd-profile", "version": 1,
     "model": "smollm2", "cpu": "<model name of /proc/cpuinfo>", "threads": 2,
     "fingerprint": "fp_...", "block_size": 16, "kv_bytes_per_token": 9216,
     "num_layers": 30, "created": "<ISO time>",
     "dtype": "float32", "chunked_prefill": true,   # false: the engine prefills whole prompts
     "costs": {StepCosts fields},            # kvd/sim/costs.py
     "samples": {"prefill": [[n, c, s]...], "decode": [[batch, context, s]...],
                 "swap": [[blocks, s]...], "transfer": [[bytes, s]...]},
     "fit": {"prefill_median_error": 0.03, ...},
     "serving": {"first_token_s": 0.03,      # optional (tools/sim/measure.py); absent: 0
                 "token_s": 0.001,           # optional; absent: 0
                 "disagg_s": 0.01, ...},     # optional; absent: 0
     "cache": {CacheCosts fields},           # optional (kvd/sim/warmth.py); absent: always warm
     "wake": [[gap_s, extra_s], ...],        # optional (kvd/sim/wake.py); absent: no wake cost
     "reference": {"prefill_s": 0.16, "decode_s": 0.007,   # optional (tools/sim/speed_ref.py): the
                   "readings": [[prefill_s, decode_s], ...]},  # host's speed when it was measured
     "host_cpus": 2}                         # optional: the CPUs kvd profile could use; absent: 0

A profile describes one model on one CPU: ``load_profile`` refuses one made
for another model or another CPU when asked to check them (one-line
``ProfileError``). Torch-free: the coordinator and the config loader read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvd.sim.costs import StepCosts
from kvd.sim.wake import WakeCosts
from kvd.sim.warmth import CacheCosts

KIND = "kvd-profile"
VERSION = 1
MAX_BYTES = 16 << 20


class ProfileError(ValueError):
    """A profile that cannot be used here (the reason, one line)."""


@dataclass(frozen=True)
class Profile:
    model: str
    cpu: str
    threads: int
    fingerprint: str
    block_size: int
    kv_bytes_per_token: int
    num_layers: int
    costs: StepCosts
    doc: dict                                  # the whole document, as read
    serving_s: float = 0.0                     # a request's time before routing that no step models
    serving_token_s: float = 0.0               # the serving path's time per step with a decode part (event loop, SSE)
    serving_disagg_s: float = 0.0              # a disaggregated request's time to its prefill leg that no hop models
    cache: CacheCosts | None = None            # the weights' last-level cache model; None: always warm
    host_cpus: int = 0                         # the CPUs the profiled process could use (0: not recorded)
    wake: WakeCosts | None = None              # a step's cost after a wait for work; None: none

    def engine_costs(self) -> dict[str, float]:
        """The engine's caching cost coefficients (``[engine].cost_*_s``) this profile measured."""
        c = self.costs
        return {"cost_token_s": c.prefill_token_s, "cost_attention_s": c.prefill_attention_s,
                "cost_fixed_s": c.prefill_fixed_s, "cost_swap_block_s": c.swap_block_s}


def this_cpu() -> str:
    """The CPU's model name, as profiles and kvd-loadgen results record it."""
    from engine.cpus import cpu_model

    return cpu_model() or "unknown"


def parse_profile(doc: object, where: str = "profile") -> Profile:
    """Validate a decoded profile document; raises ProfileError naming what is wrong."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ProfileError(f"{where}: not a kvd profile (no \"kind\": \"{KIND}\")")
    if doc.get("version") != VERSION:
        raise ProfileError(f"{where}: profile version {doc.get('version')!r}, this kvd reads {VERSION}")
    try:
        costs = StepCosts.from_dict(doc.get("costs"))
    except (ValueError, TypeError) as exc:
        raise ProfileError(f"{where}: {exc}") from None
    for key, typ in (("model", str), ("cpu", str), ("fingerprint", str)):
        if not isinstance(doc.get(key), typ) or not doc[key]:
            raise ProfileError(f"{where}: \"{key}\" must be a non-empty string")
    for key in ("threads", "block_size", "kv_bytes_per_token", "num_layers"):
        v = doc.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ProfileError(f"{where}: \"{key}\" must be an integer >= 1, got {v!r}")
    serving = doc.get("serving", {})
    keys = ("first_token_s", "token_s", "disagg_s")
    times = [serving.get(k, 0.0) for k in keys] if isinstance(serving, dict) else [None]
    if any(isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 3600 for t in times):
        raise ProfileError(f"{where}: \"serving\" must be an object whose \"first_token_s\", \"token_s\" and "
                           f"\"disagg_s\" are seconds in [0, 3600), got {serving!r}")
    host_cpus = doc.get("host_cpus", 0)
    if isinstance(host_cpus, bool) or not isinstance(host_cpus, int) or not 0 <= host_cpus <= 4096:
        raise ProfileError(f"{where}: \"host_cpus\" must be an integer in [0, 4096], got {host_cpus!r}")
    ref = doc.get("reference", {"prefill_s": 1.0, "decode_s": 1.0})
    if not isinstance(ref, dict) or any(isinstance(ref.get(k), bool) or not isinstance(ref.get(k), (int, float))
                                        or not 0 < ref[k] < 3600 for k in ("prefill_s", "decode_s")):
        raise ProfileError(f"{where}: \"reference\" must be an object whose \"prefill_s\" and \"decode_s\" are "
                           f"seconds in (0, 3600), got {ref!r}")
    try:
        cache = CacheCosts.from_dict(doc["cache"]) if "cache" in doc else None
        wake = WakeCosts.from_object(doc["wake"]) if "wake" in doc else None
    except ValueError as exc:
        raise ProfileError(f"{where}: {exc}") from None
    return Profile(model=doc["model"], cpu=doc["cpu"], threads=doc["threads"], fingerprint=doc["fingerprint"],
                   block_size=doc["block_size"], kv_bytes_per_token=doc["kv_bytes_per_token"],
                   num_layers=doc["num_layers"], costs=costs, doc=doc, serving_s=float(times[0]),
                   serving_token_s=float(times[1]), serving_disagg_s=float(times[2]), cache=cache,
                   host_cpus=host_cpus, wake=wake)


def load_profile(path: str | Path, *, model: str | None = None, check_cpu: bool = True) -> Profile:
    """Read and validate the profile at ``path``. ``model``: refuse a profile of
    another model; ``check_cpu``: refuse one measured on another CPU. Raises ProfileError."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_BYTES:
            raise ProfileError(f"profile {path}: larger than {MAX_BYTES >> 20} MiB")
        doc = json.loads(p.read_text(), parse_constant=_no_constant)
    except FileNotFoundError:
        raise ProfileError(f"profile {path} not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, ProfileError):
            raise
        raise ProfileError(f"profile {path}: not JSON ({exc})") from None
    prof = parse_profile(doc, f"profile {path}")
    if model is not None and prof.model != model:
        raise ProfileError(f"profile {path} was measured with model {prof.model!r}, not {model!r}")
    if check_cpu and prof.cpu != this_cpu():
        raise ProfileError(f"profile {path} was measured on {prof.cpu!r}, this machine is {this_cpu()!r}")
    return prof


def write_profile(doc: dict, path: str | Path) -> Path:
    """Write ``doc`` (checked with parse_profile first) as indented JSON."""
    parse_profile(doc)
    p = Path(path)
    if p.parent != Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1) + "\n")
    return p


PREFILL_COSTS = ("prefill_fixed_s", "prefill_token_s", "prefill_attention_s")
DECODE_COSTS = ("decode_fixed_s", "decode_seq_s", "decode_context_s", "swap_block_s")


def at_speed(doc: dict, prefill: float, decode: float) -> dict:
    """A copy of the profile document ``doc`` on a host ``prefill`` and
    ``decode`` times as slow as the one it was measured on (the ratios of
    tools/sim/speed_ref.py's readings): prefill costs scale by ``prefill``;
    decode steps, swaps, the cold weights' read and the wake's extra by
    ``decode``; the serving path's overheads by their mean. Transfers and
    times that are not costs (how long the cache takes to cool) stay."""
    if not (0 < prefill < 100 and 0 < decode < 100):
        raise ValueError(f"speed ratios must be in (0, 100), got {prefill!r}, {decode!r}")
    out = json.loads(json.dumps(doc))
    c = out["costs"]
    for k in PREFILL_COSTS:
        c[k] *= prefill
    for k in DECODE_COSTS:
        c[k] *= decode
    c["decode_batch_s"] = [[b, t * decode] for b, t in c.get("decode_batch_s", [])]
    if "cache" in out:
        out["cache"]["decode_cold_s"] *= decode
    if "wake" in out:
        out["wake"] = [[g, e * decode] for g, e in out["wake"]]
    serving = out.get("serving", {})
    for k in ("first_token_s", "token_s", "disagg_s"):
        if k in serving:
            serving[k] *= (prefill + decode) / 2
    if "reference" in out:
        out["reference"] = {"prefill_s": out["reference"]["prefill_s"] * prefill,
                            "decode_s": out["reference"]["decode_s"] * decode}
    return out


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a profile may hold")
