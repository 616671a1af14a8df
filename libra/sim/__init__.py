"""Cluster simulation: workload generators (`libra.sim.workloads`) and the discrete-event
simulator that runs RL post-training systems on virtual time, driving the real routing
policies and planner (`libra simulate`; docs/simulation.md, docs/baselines.md).

    from libra.sim.config import SimConfig
    from libra.sim.runner import simulate
    from libra.sim.systems import resolve
    result = simulate(SimConfig(workload="search-r1", steps=20), resolve("libra,verl-colocated"))
"""
