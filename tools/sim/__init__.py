"""``kvd profile``, ``kvd simulate`` and ``kvd plan``: the profiler, the simulator's
command (kvd-loadgen's workloads in, a kvd-loadgen result out) and the planner.
The simulator itself, which runs kvd's own decision code, is kvd/sim/."""
