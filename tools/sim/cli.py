"""The ``kvd profile``, ``kvd simulate`` and ``kvd plan`` subcommands (tools/kvd_command.py adds them to kvd/cli.py's).

``simulate`` and ``plan`` take kvd-loadgen's workload flags after their own,
so their arguments are parsed by their modules (tools/sim/run.py, tools/sim/plan.py)
from the rest of the command line; every bad flag is one line and exit 2.
"""

from __future__ import annotations

import argparse


def add_sim_parsers(sub) -> None:
    """Add the three subcommands to ``kvd``'s subparsers."""
    prof = sub.add_parser("profile", help="measure this machine with the served model; write a JSON profile")
    prof.add_argument("-c", "--config", help="TOML config (the [engine] to profile; see etc/kvd.toml)")
    prof.add_argument("--model", default=None, help="model spec (default: [engine].model, else smollm2)")
    prof.add_argument("--output", required=True, metavar="PROFILE.json", help="where to write the profile")
    prof.add_argument("--quick", action="store_true", help="small grids: seconds instead of minutes")
    prof.add_argument("--serving-requests", type=int, default=None, metavar="N",
                      help="requests through each real kvd serve (one node, then one prefill and one "
                           "decode node; three servers of each, one with --quick) to measure the serving "
                           "overhead (default 16; 0 skips it, the default with --quick)")
    for name, what in (("simulate", "simulate a kvd cluster on a profile with kvd-loadgen's workload flags"),
                       ("plan", "search cluster shapes in the simulator for the best goodput per node")):
        p = sub.add_parser(name, help=what, add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs=argparse.REMAINDER)


def run_sim_command(args: argparse.Namespace) -> int:
    if args.command == "profile":
        from tools.sim.profile import main
        return main(args)
    if args.command == "simulate":
        from tools.sim.run import main
        return main(args.rest)
    from tools.sim.plan import main
    return main(args.rest)
