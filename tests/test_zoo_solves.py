"""Every zoo model solves, on two devices each, at a RAM budget below its plain-training peak, and
the schedule passes the independent validator.

Time-limited on purpose (the heuristic MIP start gives an incumbent at once); what is checked is
validity and the budgets, not optimality.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import pytest

from poet_opt.schedule.validator import TOTAL_KEYS, validate
from poet_opt.solver.driver import solve
from poet_opt.model.zoo import MODELS, build_model
from poet_opt.schedule.document import PROVEN_STATUSES, STATUSES

TIME_LIMIT = 3.0  # per case; the large models (300+ nodes) stop here with a valid incumbent
GAP = 1e-2
RAM_FRACTION = 0.8
RUNTIME_FACTOR = 1.5

MCU_MODELS = {"mlp", "mlp-residual", "mcu-vww"}
MCU_DEVICES = ("nrf52840", "stm32f746")
BOARD_DEVICES = ("rpi4", "jetson-tx2")

CASES = [
    pytest.param(model, device, id=f"{model}-{device}")
    for model in MODELS
    for device in (MCU_DEVICES if model in MCU_MODELS else BOARD_DEVICES)
]


@lru_cache(maxsize=None)
def _graph(model):
    return build_model(model)


def test_every_zoo_model_is_covered_on_two_devices():
    covered = {}
    for case in CASES:
        model, device = case.values
        covered.setdefault(model, set()).add(device)
    assert set(covered) == set(MODELS)
    assert all(len(devices) >= 2 for devices in covered.values())


@pytest.mark.parametrize("model, device", CASES)
def test_zoo_model_solves_below_its_plain_peak(model, device):
    graph = _graph(model)
    peak = graph.plain_peak_bytes()
    ram = int(RAM_FRACTION * peak)
    schedule = solve(graph, device, ram=ram, runtime=f"{RUNTIME_FACTOR}x", time_limit=TIME_LIMIT, gap=GAP,
                     model_name=model)

    doc = json.loads(json.dumps(schedule.to_dict()))  # as written to a schedule file
    recomputed = validate(doc)
    for key, integer in TOTAL_KEYS.items():
        if integer:
            assert recomputed[key] == schedule.totals[key], key
        else:
            assert math.isclose(recomputed[key], schedule.totals[key], rel_tol=1e-9, abs_tol=1e-300), key

    totals, plain = schedule.totals, schedule.plain
    assert totals["peak_ram_bytes"] <= ram < peak
    assert totals["runtime_s"] <= RUNTIME_FACTOR * plain["runtime_s"] * (1 + 1e-9)
    assert totals["energy_j"] >= plain["energy_j"] * (1 - 1e-12)
    # below the plain peak something has to give: a recomputation or a page-in
    assert totals["recomputes"] + totals["page_ins"] > 0
    assert schedule.solver["status"] in STATUSES, schedule.solver
    if schedule.solver["status"] in PROVEN_STATUSES:
        assert schedule.solver["gap"] is not None and schedule.solver["gap"] <= GAP * (1 + 1e-6)
    assert doc["model"] == model and doc["device"]["name"] == device
