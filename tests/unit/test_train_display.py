"""The live display's ETA: timed from the first step this process finished."""

from __future__ import annotations

from libra.train.display import View, render


def _eta(v: View, now: float) -> str | None:
    head = render(v, now=now)[0]
    return head.split("eta ")[1] if "eta " in head else None


def test_eta_ignores_the_pipeline_fill_and_a_resumed_runs_earlier_steps() -> None:
    # resumed at step 40 of 100; the phase started at t=0, and the first step, which also
    # filled the pipeline, took 100 s; steps then take 10 s each
    v = View(steps=100, started=0.0, phase="training")
    v.step = 40
    v.stepped(41, now=100.0)
    assert _eta(v, now=100.0) is None  # one step says nothing about the rate yet
    v.stepped(42, now=110.0)
    # 10 s per step x 58 steps left (timed from the phase start it read 2m31s: 42 steps
    # "in" 110 s)
    assert _eta(v, now=110.0) == "9m40s"
    v.stepped(43, now=120.0)
    assert _eta(v, now=120.0) == "9m30s"
