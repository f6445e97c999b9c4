"""Static arena and flash layout: no two tensors live at the same time share a byte, offsets are
aligned, the arena is never below the live peak, and the per-step offsets are the ones a replay of
the steps would use. Schedules come from the real solver on random graphs with skip connections."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poet_opt.device.media import erased_bytes
from poet_opt.firmware.arena import check_fits, check_flash, check_no_overlap, plan_arena, plan_flash, wear_levelled_lifetime
from poet_opt.errors import PoetError
from poet_opt.model.random_graph import random_training_graph
from poet_opt.solver.driver import solve
from poet_opt.schedule.validator import validate

_CACHE: dict = {}


def solved_doc(device, n_forward: int, seed: int, frac: float) -> dict:
    """A validated schedule whose budget lies between the graph's minimum working set and its plain peak."""
    key = (n_forward, seed, round(frac, 2))
    if key not in _CACHE:
        g = random_training_graph(n_forward, seed)
        lo, hi = g.min_working_set_bytes(), g.plain_peak_bytes()
        _CACHE[key] = solve(g, device, ram=int(lo + key[2] * (hi - lo)), time_limit=10).to_dict()
    return copy.deepcopy(_CACHE[key])


def replay_offsets(doc: dict, plan) -> None:
    """Walk the steps as firmware would, tracking where each resident tensor sits."""
    nodes = doc["graph"]["nodes"]
    where: dict[int, int] = {}
    for s, step in enumerate(doc["steps"]):
        op, n = step["op"], step["node"]
        if op in ("compute", "page_in"):
            assert n not in where
            where[n] = plan.step_offsets[s]
        else:
            assert plan.step_offsets[s] == where[n], f"step {s} {op} {n} not at its resident offset"
        if op == "compute":
            assert plan.operand_offsets[s] == [where[d] for d in nodes[n]["deps"]]
        else:
            assert plan.operand_offsets[s] == []
        if op == "free":
            del where[n]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_forward=st.integers(3, 8), seed=st.integers(0, 50), frac=st.floats(0.0, 1.0),
       alignment=st.sampled_from([1, 4, 16, 64]))
def test_arena_never_overlaps_live_tensors(test_device, n_forward, seed, frac, alignment):
    doc = solved_doc(test_device, n_forward, seed, frac)
    doc["device"]["alignment_bytes"] = alignment
    totals = validate(doc)
    plan = plan_arena(doc)
    check_no_overlap(plan)
    assert all(o % alignment == 0 for o in plan.offsets)
    assert plan.live_peak_bytes == totals["peak_ram_bytes"]
    assert plan.arena_bytes >= plan.lower_bound_bytes >= plan.live_peak_bytes
    replay_offsets(doc, plan)

    flash = plan_flash(doc)
    check_flash(flash)
    paged = {s["node"] for s in doc["steps"] if s["op"] == "page_out"}
    assert set(flash.offsets) == paged
    assert flash.bytes_written_per_step == sum(doc["graph"]["nodes"][s["node"]]["bytes"]
                                               for s in doc["steps"] if s["op"] == "page_out")
    if paged and flash.wear_levelling:  # an SD card's translation layer spreads erases over the card
        nodes, block, capacity = doc["graph"]["nodes"], flash.erase_block, doc["device"]["storage_capacity_bytes"]
        assert flash.packed == (doc["device"]["storage_kind"] == "sd-card")

        def units(n):  # allocation units the page-out's commands touch: whole sectors, then a partial one
            b, o = nodes[n]["bytes"], flash.offsets[n]
            whole = b // 512 * 512
            return len(range(o // block, (o + whole - 1) // block + 1)) + (b > whole)

        erased = sum(w * units(n) * block for n, w in flash.writes_per_step.items())
        assert flash.lifetime_steps == flash.endurance_cycles * capacity // erased
        worst = sum(w * erased_bytes(nodes[n]["bytes"], "sd-card", True, block)
                    for n, w in flash.writes_per_step.items())
        assert flash.lifetime_steps >= flash.endurance_cycles * capacity // worst  # the plan's figure holds
    elif paged:  # raw flash: the most rewritten region wears out first
        assert flash.lifetime_steps == min(flash.endurance_cycles // w for w in flash.writes_per_step.values())
    else:
        assert flash.lifetime_steps is None and flash.flash_bytes == 0


def test_arena_matches_live_peak_on_solved_random_graphs(test_device):
    """Greedy placement is not optimal in general; with restarts it should be close on these schedules."""
    for seed in range(4):
        plan = plan_arena(solved_doc(test_device, 8, seed, 0.1))
        assert plan.arena_bytes <= 1.05 * plan.live_peak_bytes, (seed, plan.ratio)


def tiny_doc(steps, sizes, deps=None, alignment=1, erase_block=4096, endurance=100) -> dict:
    deps = deps or [[] for _ in sizes]
    nodes = [{"id": i, "name": f"n{i}", "bytes": b, "deps": d} for i, (b, d) in enumerate(zip(sizes, deps))]
    return {"device": {"alignment_bytes": alignment, "erase_block_bytes": erase_block, "endurance_cycles": endurance},
            "graph": {"nodes": nodes}, "budgets": {"ram_bytes": None},
            "steps": [{"op": op, "node": n} for op, n in steps]}


def test_recomputed_tensor_gets_a_new_interval_and_operands_follow_it():
    doc = tiny_doc([("compute", 0), ("compute", 1), ("free", 0), ("compute", 2), ("compute", 0), ("compute", 3),
                    ("free", 0), ("free", 1), ("free", 2), ("free", 3)],
                   [8, 8, 8, 8], deps=[[], [0], [1], [0, 2]])
    plan = plan_arena(doc)
    check_no_overlap(plan)
    assert [iv.node for iv in plan.intervals] == [0, 1, 2, 0, 3]
    assert plan.live_peak_bytes == 32
    replay_offsets(doc, plan)


def test_alignment_pads_between_tensors_and_check_fits_reports_it():
    doc = tiny_doc([("compute", 0), ("compute", 1), ("free", 0), ("free", 1)], [4, 4], alignment=16)
    plan = plan_arena(doc)
    assert sorted(plan.offsets) == [0, 16] and plan.arena_bytes == 20 and plan.live_peak_bytes == 8
    doc["budgets"]["ram_bytes"] = 8
    with pytest.raises(PoetError, match=r"arena needs 20 B, more than the RAM budget 8 B \(live peak 8 B"):
        check_fits(doc, plan)
    doc["budgets"]["ram_bytes"] = 20
    check_fits(doc, plan)


def test_check_no_overlap_catches_a_collision():
    doc = tiny_doc([("compute", 0), ("compute", 1), ("free", 0), ("free", 1)], [8, 8], alignment=4)
    plan = plan_arena(doc)
    plan.offsets = [0, 4]
    with pytest.raises(AssertionError, match="overlaps"):
        check_no_overlap(plan)
    plan.offsets = [0, 10]
    with pytest.raises(AssertionError, match="aligned"):
        check_no_overlap(plan)


def test_flash_regions_are_erase_block_aligned_and_lifetime_counts_rewrites():
    steps = [("compute", 0), ("page_out", 0), ("free", 0), ("compute", 1), ("page_out", 1), ("free", 1),
             ("page_in", 0), ("page_out", 0), ("free", 0)]
    doc = tiny_doc(steps, [5000, 100], erase_block=4096, endurance=1000)
    flash = plan_flash(doc)
    check_flash(flash)
    assert flash.offsets == {0: 0, 1: 8192}
    assert flash.region_bytes == {0: 8192, 1: 4096} and flash.flash_bytes == 12288
    assert flash.bytes_written_per_step == 5000 + 100 + 5000
    # node 0's blocks are erased twice per training step, so they wear out first
    assert flash.writes_per_step == {0: 2, 1: 1} and flash.lifetime_steps == 500
    assert wear_levelled_lifetime(flash) == 1000 * 12288 // (2 * 8192 + 4096)


@pytest.mark.parametrize("device, needle", [
    (None, "no 'device' section"),
    ({"alignment_bytes": 0, "erase_block_bytes": 4096, "endurance_cycles": 1}, "device.alignment_bytes is 0"),
    ({"alignment_bytes": 4.5, "erase_block_bytes": 4096, "endurance_cycles": 1}, "device.alignment_bytes is 4.5"),
    ({"alignment_bytes": True, "erase_block_bytes": 4096, "endurance_cycles": 1}, "device.alignment_bytes is True"),
])
def test_bad_device_section_is_a_poet_error(device, needle):
    doc = tiny_doc([("compute", 0), ("free", 0)], [4])
    doc["device"] = device
    with pytest.raises(PoetError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        plan_arena(doc)
