"""A small Nelder-Mead minimiser (numpy only: the runtime does not depend on scipy).

Used by `libra.planner.fit` to fit a handful of cost-model parameters to measured step
times. The objective there is a sum of squared log errors of a piecewise-linear model
(the cost model's `max(memory, compute)`), which has kinks where a sample changes
regime: a derivative-free simplex method copes with those, and with 4 to 8 parameters it
converges in a few thousand evaluations, well under a second.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def nelder_mead(
    f: Callable[[np.ndarray], float],
    x0: np.ndarray,
    *,
    step: float = 0.5,
    max_evals: int = 4000,
    tol: float = 1e-10,
    restarts: int = 2,
) -> tuple[np.ndarray, float]:
    """Minimise `f` from `x0`; returns (best x, f(best x)).

    Standard coefficients (reflection 1, expansion 2, contraction 1/2, shrink 1/2). The
    search restarts `restarts` times from the best point with a fresh simplex, which
    recovers from a simplex that collapsed onto a kink."""
    best = np.asarray(x0, dtype=float)
    best_f = f(best)
    budget = max_evals
    for _ in range(restarts + 1):
        best, best_f, used = _run(f, best, best_f, step, budget, tol)
        budget -= used
        if budget <= 0:
            break
    return best, best_f


def _run(
    f: Callable[[np.ndarray], float],
    x0: np.ndarray,
    f0: float,
    step: float,
    max_evals: int,
    tol: float,
) -> tuple[np.ndarray, float, int]:
    n = x0.size
    simplex = np.vstack([x0] + [x0 + step * np.eye(n)[i] for i in range(n)])
    values = np.array([f0] + [f(x) for x in simplex[1:]])
    evals = n
    while evals < max_evals:
        order = np.argsort(values)
        simplex, values = simplex[order], values[order]
        if values[-1] - values[0] <= tol * (abs(values[0]) + tol):
            break
        centroid = simplex[:-1].mean(axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        evals += 1
        if fr < values[0]:
            xe = centroid + 2.0 * (centroid - worst)
            fe = f(xe)
            evals += 1
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
            continue
        if fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
            continue
        inside = fr >= values[-1]
        xc = centroid + 0.5 * ((worst if inside else xr) - centroid)
        fc = f(xc)
        evals += 1
        if fc < min(fr, values[-1]):
            simplex[-1], values[-1] = xc, fc
            continue
        simplex[1:] = simplex[0] + 0.5 * (simplex[1:] - simplex[0])
        values[1:] = [f(x) for x in simplex[1:]]
        evals += n
    i = int(np.argmin(values))
    return simplex[i].copy(), float(values[i]), evals


__all__ = ["nelder_mead"]
