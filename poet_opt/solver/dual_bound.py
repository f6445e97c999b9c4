"""A lower bound from any dual vector: the LP's Lagrangian dual function, proven by its own arithmetic.

For the LP ``min c.x + offset  s.t.  row_lb <= A x <= row_ub,  lb <= x <= ub`` (a Milp with its
integrality dropped, which only lowers its minimum) and any vector ``y`` of row multipliers, every
feasible ``x`` satisfies, row by row, ``y_i (A_i x - r_i) >= 0`` with ``r_i = row_lb_i`` where
``y_i > 0`` and ``r_i = row_ub_i`` where ``y_i < 0`` (a multiplier against an infinite side is set
to zero first). So

    c.x  >=  c.x - y.(A x - r)  =  y.r + (c - A'y).x  >=  y.r + sum_j min(d_j lb_j, d_j ub_j),

with ``d = c - A'y`` the reduced costs, when every column with ``d_j != 0`` is bounded on the side
its sign picks (one that is not gives no bound from this ``y``). The right-hand side is a lower bound on the
LP's optimum, hence on every integer point, whatever ``y`` is: an interior-point iterate stopped
without crossover, a first-order method's iterate, a time-limited run's last answer. Its value
never rests on the solver's claim of optimality or on its tolerances; at the exact optimal duals it
equals the LP optimum (strong duality), and near them it is near it.

Floating point: ``d`` and the sums are computed in float64. By the standard bound on a sum or dot
product of ``k`` terms (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1), each computed
``d_j`` is within ``gamma_k (|c_j| + sum_i |A_ij| |y_i|)`` of the exact one, with ``gamma_k = k u /
(1 - k u)`` and ``u`` the unit roundoff, and the computed total within ``gamma_N`` times the sum of
its terms' magnitudes. The value returned is the computed one less twice the sum of those bounds,
with ``k`` and ``N`` both taken as the number of rows plus columns plus the longest column: a
margin of order 1e-10 relative to the terms' magnitudes at the residency model's sizes, so what is
returned is at most the exact dual function of this ``y``, itself at most the LP's optimum.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from poet_opt.solver.backends import interrupted
from poet_opt.solver.formulation import Milp

UNIT_ROUNDOFF = np.finfo(float).eps / 2
# dual_ascent: each step's direction is the subgradient plus this much of the step before (a
# deflected subgradient, which zig-zags less), and the step halves after STALL steps without a better value
DEFLECTION = 0.7
STALL = 60


def dual_bound(milp: Milp, duals: np.ndarray) -> Optional[float]:
    """The Lagrangian dual function of ``milp``'s LP relaxation at row multipliers ``duals`` (one per
    row, the sign convention of the module docstring: ``c - A'y`` are the reduced costs), less the
    floating-point margin: a proven lower bound on the LP's optimum and so on the MILP's. None when
    this ``duals`` gives none (a column unbounded on the side its reduced cost picks)."""
    y = np.array(duals, dtype=float, copy=True).reshape(-1)
    if y.shape[0] != milp.num_rows:
        raise ValueError(f"{y.shape[0]} multipliers for {milp.num_rows} rows")
    y[~np.isfinite(y)] = 0.0
    row_lb, row_ub = np.asarray(milp.row_lb, dtype=float), np.asarray(milp.row_ub, dtype=float)
    y[(y > 0) & ~np.isfinite(row_lb)] = 0.0  # only a finite side may be leaned on
    y[(y < 0) & ~np.isfinite(row_ub)] = 0.0
    side = np.where(y > 0, np.where(np.isfinite(row_lb), row_lb, 0.0),
                    np.where(y < 0, np.where(np.isfinite(row_ub), row_ub, 0.0), 0.0))
    row_terms = y * side
    A = milp.A.tocsc()
    c = np.asarray(milp.c, dtype=float)
    d = c - A.T @ y
    lb, ub = np.asarray(milp.lb, dtype=float), np.asarray(milp.ub, dtype=float)
    pos, neg = d > 0, d < 0
    longest = int(np.diff(A.indptr).max(initial=0))
    k = milp.num_rows + milp.num_vars + longest + 4
    gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
    d_scale = np.abs(c) + abs(A).T @ np.abs(y)
    # A column unbounded below needs d_j <= 0 exactly, above d_j >= 0: asked of the computed d_j
    # widened by its rounding bound (so a free column gives a bound only where d_j is exactly zero)
    slack = 2 * gamma * d_scale
    if np.any(~np.isfinite(lb) & (d + slack > 0)) or np.any(~np.isfinite(ub) & (d - slack < 0)):
        return None
    at = np.where(pos, np.where(np.isfinite(lb), lb, 0.0), np.where(neg, np.where(np.isfinite(ub), ub, 0.0), 0.0))
    col_terms = d * at
    value = float(milp.offset) + float(row_terms.sum()) + float(col_terms.sum())
    if not math.isfinite(value):
        return None
    # the margin of the module docstring: d's rounding (times the column's larger bound) and the sums'
    reach = np.maximum(np.where(np.isfinite(lb), np.abs(lb), 0.0), np.where(np.isfinite(ub), np.abs(ub), 0.0))
    magnitude = abs(float(milp.offset)) + float(np.abs(row_terms).sum()) + float(np.abs(col_terms).sum()) \
        + float((reach * d_scale).sum())
    return value - 2 * gamma * magnitude


def dual_ascent(milp: Milp, duals: np.ndarray, *, target: float, time_limit: float,
                iterations: int = 1_000_000) -> tuple[Optional[float], np.ndarray]:
    """Raises the dual function of ``milp``'s LP (every column boxed) from ``y = duals`` by projected
    subgradient steps (Polyak's, aimed at ``target``, an upper bound such as a plan's objective,
    halved after STALL steps without a better value), and returns ``dual_bound`` of the best ``y`` seen,
    and that ``y``. Each step costs two products with ``A``. The steps only choose candidates: the
    value returned is dual_bound's own computation at the chosen ``y``, so how they are chosen bears
    on the value, never on its validity. Rows with one finite side keep the sign of multiplier it
    allows. A subgradient of the dual function at ``y`` is ``r - A x``, ``x`` the box's minimizer of
    the reduced costs and ``r`` the side each multiplier leans on (for a zero one, ``A x`` clipped
    into the row's range)."""
    import time

    started = time.perf_counter()
    lb, ub = np.asarray(milp.lb, dtype=float), np.asarray(milp.ub, dtype=float)
    if not (np.all(np.isfinite(lb)) and np.all(np.isfinite(ub))):
        return dual_bound(milp, duals), np.asarray(duals, dtype=float)  # the steps below assume a box
    A = milp.A.tocsr()
    AT = A.T.tocsr()
    c = np.asarray(milp.c, dtype=float)
    row_lb, row_ub = np.asarray(milp.row_lb, dtype=float), np.asarray(milp.row_ub, dtype=float)
    has_lo, has_hi = np.isfinite(row_lb), np.isfinite(row_ub)
    lo_side, hi_side = np.where(has_lo, row_lb, -np.inf), np.where(has_hi, row_ub, np.inf)
    lo_val, hi_val = np.where(has_lo, row_lb, 0.0), np.where(has_hi, row_ub, 0.0)

    def project(v: np.ndarray) -> np.ndarray:
        v = np.where(np.isfinite(v), v, 0.0)
        v = np.where(has_lo, v, np.minimum(v, 0.0))
        return np.where(has_hi, v, np.maximum(v, 0.0))

    def value_at(v: np.ndarray, d: np.ndarray) -> float:  # the dual function, without the margin
        return float(milp.offset + (v * np.where(v > 0, lo_val, hi_val)).sum() + np.minimum(d * lb, d * ub).sum())

    y = project(np.array(duals, dtype=float))
    d = c - AT @ y
    value = value_at(y, d)
    best, best_y, theta, stall = value, y, 1.0, 0
    direction = np.zeros_like(y)
    for _ in range(iterations):
        if time.perf_counter() - started > time_limit or theta < 1e-7 or interrupted():
            break
        x = np.where(d < 0, ub, lb)
        ax = A @ x
        r = np.where(y > 0, lo_side, np.where(y < 0, hi_side, np.clip(ax, lo_side, hi_side)))
        grad = r - ax
        grad[(y == 0) & ~has_lo & (grad > 0)] = 0.0  # steps out of a one-sided row's sign are none
        grad[(y == 0) & ~has_hi & (grad < 0)] = 0.0
        direction = grad + DEFLECTION * direction
        norm = float(direction @ direction)
        if not norm > 0 or not math.isfinite(norm):
            break
        step = theta * max(target - value, 1e-6 * abs(target), 1e-12) / norm
        y = project(y + step * direction)
        d = c - AT @ y
        value = value_at(y, d)
        if value > best + 1e-12 * abs(target):
            best, best_y, stall = value, y, 0
        else:
            stall += 1
            if stall >= STALL:
                theta, stall = theta / 2, 0
    return dual_bound(milp, best_y), best_y
