"""Shared by the simulator tests: one system run to its end on an environment."""

from __future__ import annotations

from libra.sim.cluster import Simulation
from libra.sim.systems import SYSTEMS


def run(env, name: str, layout=None) -> Simulation:
    sim = Simulation(SYSTEMS[name], env, layout)
    sim.run()
    return sim
