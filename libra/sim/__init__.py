"""Cluster simulation: workload generators (`libra.sim.workloads`) and, later, the
discrete-event simulator that drives the real routing and planner code on virtual time."""
