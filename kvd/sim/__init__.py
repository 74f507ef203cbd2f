"""kvd's discrete-event simulator of a cluster (``kvd simulate``) and what it reads.

The simulator runs kvd's own decision code (the coordinator's routers and
prefill-queue bound, the engine's Scheduler over a MemPool) against simulated
time; only the duration of each engine step, swap and KV transfer comes from
a profile of the machine (``kvd profile``). Modules: ``events`` (the clock and
event queue), ``costs`` (the step-time model), ``profile_file`` (the profile
on disk), ``node`` (a simulated node), ``cluster`` (nodes + coordinator),
``faults`` (nodes killed at given times). The command, the workload and the
planner that drive it are tools/sim/.
"""
