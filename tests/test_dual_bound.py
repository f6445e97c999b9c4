"""The dual-function bound (poet_opt/solver/dual_bound.py) is proven by its own arithmetic: on random
small boxed LPs it never exceeds the LP's optimum, whatever the multipliers, and at the optimal
multipliers HiGHS reports it equals the optimum; so does it from an interior-point run stopped
without crossover."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from poet_opt.solver.backends import solve_milp
from poet_opt.solver.dual_bound import dual_ascent, dual_bound
from poet_opt.solver.formulation import Milp

REL = 1e-7  # HiGHS's tolerances on an objective of order one


@st.composite
def boxed_lps(draw):
    """A feasible LP (a random point meets every row) with every column in [lb, ub], rows of every
    kind: >=, <=, ranges, equalities."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    m, n = draw(st.integers(1, 8)), draw(st.integers(1, 10))
    dense = rng.normal(size=(m, n)) * (rng.random((m, n)) < 0.6)
    lb = np.where(rng.random(n) < 0.7, 0.0, -rng.random(n) * 3)
    ub = lb + rng.random(n) * 4
    x0 = lb + rng.random(n) * (ub - lb)
    ax = dense @ x0
    kind = rng.integers(0, 4, size=m)  # 0: >=, 1: <=, 2: range, 3: equality
    row_lb = np.where(kind == 1, -np.inf, ax - rng.random(m) * (kind != 3))
    row_ub = np.where(kind == 0, np.inf, np.where(kind == 3, ax, ax + rng.random(m)))
    c = rng.normal(size=n) * draw(st.sampled_from((1e-3, 1.0, 1e3)))
    return Milp(c=c, offset=float(rng.normal()), A=sp.csr_matrix(dense), row_lb=row_lb, row_ub=row_ub,
                lb=lb, ub=ub, integrality=np.zeros(n, dtype=np.int8))


def optimum(milp: Milp):
    result = solve_milp(milp, gap=0.0, time_limit=20)
    # (an LP's status reads "gap_limit" where HiGHS's MIP dual bound field says nothing of it)
    assert result.status in ("optimal", "gap_limit"), result.status
    return result


@settings(max_examples=150, deadline=None, derandomize=True, print_blob=True)
@given(boxed_lps(), st.data())
def test_any_multipliers_give_a_bound_below_the_lp_optimum(milp, data):
    best = optimum(milp)
    tol = REL * max(1.0, abs(best.objective))
    # HiGHS's optimal point is within its tolerances of the exact optimum: feasible to 1e-7 or so
    scale = data.draw(st.sampled_from((1e-6, 1e-2, 1.0, 1e3, 1e6)))
    raw = data.draw(st.lists(st.floats(-1, 1), min_size=milp.num_rows, max_size=milp.num_rows))
    for y in (np.array(raw) * scale, best.duals + np.array(raw) * scale * 1e-3, -best.duals, np.zeros(milp.num_rows)):
        value = dual_bound(milp, y)
        assert value is not None  # every column boxed: every vector gives a bound
        assert value <= best.objective + tol, (value, best.objective)


@settings(max_examples=60, deadline=None, derandomize=True, print_blob=True)
@given(boxed_lps())
def test_the_optimal_multipliers_give_the_optimum(milp):
    best = optimum(milp)
    value = dual_bound(milp, best.duals)
    tol = 1e-6 * max(1.0, abs(best.objective))
    assert value == pytest.approx(best.objective, abs=tol)
    ipm = solve_milp(milp, gap=0.0, time_limit=20, lp_solver="ipm")
    assert dual_bound(milp, ipm.duals) == pytest.approx(best.objective, abs=1e3 * tol)


def test_a_column_unbounded_on_the_side_its_reduced_cost_picks_gives_no_bound():
    # min x0 + x1, x0 + x1 >= 1, x0 in [0, 2], x1 >= 0 unbounded above
    milp = Milp(c=np.array([1.0, 1.0]), offset=0.0, A=sp.csr_matrix([[1.0, 1.0]]), row_lb=np.array([1.0]),
                row_ub=np.array([np.inf]), lb=np.zeros(2), ub=np.array([2.0, np.inf]),
                integrality=np.zeros(2, dtype=np.int8))
    assert dual_bound(milp, np.array([2.0])) is None  # x1's reduced cost -1, x1 unbounded above
    # reduced cost 0 on x1: exactly so here, but a column unbounded above is trusted only with a
    # reduced cost above its rounding bound
    assert dual_bound(milp, np.array([1.0])) is None
    assert dual_bound(milp, np.array([0.5])) == pytest.approx(0.5)
    # a multiplier against an infinite side counts as zero: the bound of y = 0
    assert dual_bound(milp, np.array([-3.0])) == pytest.approx(0.0)


def test_the_margin_makes_the_bound_at_most_the_exact_dual_function():
    """In exact rational arithmetic the dual function of this LP at y is known; the float result less
    its margin is at or below it, and within a few units of roundoff."""
    from fractions import Fraction

    rng = np.random.default_rng(7)
    m, n = 30, 60
    dense = rng.normal(size=(m, n)) * (rng.random((m, n)) < 0.3)
    lb, ub = np.zeros(n), rng.random(n) + 0.5
    row_lb, row_ub = dense @ (ub / 2) - 1.0, dense @ (ub / 2) + 1.0
    c, y = rng.normal(size=n), rng.normal(size=m)
    milp = Milp(c=c, offset=0.1, A=sp.csr_matrix(dense), row_lb=row_lb, row_ub=row_ub, lb=lb, ub=ub,
                integrality=np.zeros(n, dtype=np.int8))
    F = Fraction
    exact = F(0.1) + sum(F(y[i]) * F(row_lb[i] if y[i] > 0 else row_ub[i]) for i in range(m))
    for j in range(n):
        d = F(c[j]) - sum(F(dense[i, j]) * F(y[i]) for i in range(m))
        exact += min(d * F(lb[j]), d * F(ub[j]))
    value = dual_bound(milp, y)
    assert F(value) <= exact
    assert float(exact) - value < 1e-9 * max(1.0, abs(float(exact)))


@settings(max_examples=60, deadline=None, derandomize=True, print_blob=True)
@given(boxed_lps(), st.integers(0, 2**32 - 1))
def test_dual_ascent_climbs_from_its_start_and_stays_below_the_optimum(milp, seed):
    best = optimum(milp)
    y0 = np.random.default_rng(seed).normal(size=milp.num_rows)
    start = dual_bound(milp, y0)
    value, y = dual_ascent(milp, y0, target=best.objective + 1.0, time_limit=0.5)
    assert value == dual_bound(milp, y)
    assert start - 1e-12 * max(1.0, abs(start)) <= value <= best.objective + REL * max(1.0, abs(best.objective))
