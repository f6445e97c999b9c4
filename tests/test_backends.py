"""The PuLP backends solve the same bulk-built MILP as HiGHS and must agree on the optimum."""

import math

import pytest

from poet_opt.errors import PoetError
from poet_opt.model.random_graph import random_training_graph
from poet_opt.solver.driver import solve
from poet_opt.schedule.validator import validate


@pytest.mark.parametrize("mode", ["joint", "remat", "paging"])
def test_cbc_and_highs_find_the_same_optimum(test_device, mode):
    graph = random_training_graph(6, seed=3)
    ram = (graph.min_working_set_bytes() + graph.plain_peak_bytes()) // 2
    by_backend = {}
    for backend in ("highs", "cbc"):
        schedule = solve(graph, test_device, ram=ram, runtime="2x", mode=mode, backend=backend, gap=0,
                         time_limit=60)
        validate(schedule.to_dict())
        assert schedule.solver["backend"] == backend and schedule.solver["status"] in ("optimal", "optimal_for_order")
        by_backend[backend] = schedule.totals["energy_j"]
    assert math.isclose(by_backend["highs"], by_backend["cbc"], rel_tol=1e-6)


def test_unavailable_gurobi_is_a_clear_error(test_device):
    pytest.importorskip("pulp")
    import pulp

    if pulp.GUROBI(msg=False).available() or pulp.GUROBI_CMD(msg=False).available():
        pytest.skip("Gurobi is installed here")
    graph = random_training_graph(4, seed=1)
    with pytest.raises(PoetError, match="gurobi"):
        solve(graph, test_device, ram=graph.plain_peak_bytes(), backend="gurobi")
