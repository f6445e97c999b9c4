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

from poet_opt.solver.formulation import Milp

UNIT_ROUNDOFF = np.finfo(float).eps / 2


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
