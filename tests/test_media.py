"""How storage holds and wears paged tensors (poet_opt/device/media.py): sectors packed on a
wear-levelled card, whole erase blocks on raw flash, and wear counted at the worst placement of the
firmware's write commands, as the emulated card counts it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_test_device
from poet_opt.device.costs import node_costs
from poet_opt.device.media import SECTOR_BYTES, erased_bytes, occupied_bytes, packs_sectors
from poet_opt.firmware.arena import check_flash, plan_flash
from poet_opt.model.random_graph import random_training_graph
from poet_opt.schedule.validator import ScheduleInvalid, validate
from poet_opt.solver.driver import solve


def _worst_units(nbytes: int, block: int) -> int:
    """The most allocation units poet_paging.c's commands for one tensor touch, over every sector-aligned
    offset (the pattern repeats every block): its whole sectors in one write, a partial last one in another."""
    whole = nbytes // SECTOR_BYTES * SECTOR_BYTES
    worst = 0
    for offset in range(0, block, SECTOR_BYTES):
        units = len(range(offset // block, (offset + whole - 1) // block + 1)) if whole else 0
        worst = max(worst, units + (nbytes > whole))
    return worst


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 40_000), sectors_per_block=st.sampled_from([1, 2, 8, 16]))
def test_wear_on_a_packed_card_is_the_worst_placement_of_the_write_commands(nbytes, sectors_per_block):
    block = sectors_per_block * SECTOR_BYTES
    assert erased_bytes(nbytes, "sd-card", True, block) == _worst_units(nbytes, block) * block
    assert occupied_bytes(nbytes, "sd-card", True, block) == -(-nbytes // SECTOR_BYTES) * SECTOR_BYTES


@settings(max_examples=100, deadline=None)
@given(nbytes=st.integers(0, 1 << 20), block=st.sampled_from([4096, 65536]))
def test_raw_flash_and_unlevelled_cards_give_each_tensor_erase_blocks_of_its_own(nbytes, block):
    aligned = -(-nbytes // block) * block
    for kind, levelled in (("spi-flash", False), ("qspi-flash", True), ("internal-flash", False), ("sd-card", False)):
        assert not packs_sectors(kind, levelled)
        assert occupied_bytes(nbytes, kind, levelled, block) == aligned
        assert erased_bytes(nbytes, kind, levelled, block) == aligned
    assert packs_sectors("sd-card", True) and packs_sectors("emmc", True)


def _many_small_tensors_case():
    """A card of 16 allocation units of 64 KiB and a graph whose plan pages tensors of a few KiB each:
    in units of their own they would need more units than the card has."""
    device = make_test_device(capacity_bytes=16 * 65536, erase_block_bytes=65536, endurance_cycles=10_000)
    graph = random_training_graph(40, 7)
    ram = int(graph.min_working_set_bytes() + 0.1 * (graph.plain_peak_bytes() - graph.min_working_set_bytes()))
    return device, graph, ram


def test_small_paged_tensors_share_allocation_units_so_the_plan_fits_the_card():
    device, graph, ram = _many_small_tensors_case()
    schedule = solve(graph, device, ram=ram, mode="paging", time_limit=20, order="given")
    paged = sorted(schedule.decisions.page_out)
    costs = node_costs(graph, device)
    in_own_units = sum(-(-graph.nodes[i].bytes // 65536) * 65536 for i in paged)
    assert in_own_units > device.storage.capacity_bytes, "the case must need packing"
    assert float(costs.storage_bytes[paged].sum()) <= device.storage.capacity_bytes
    doc = schedule.to_dict()
    validate(doc)
    assert doc["memory"]["fits_storage"] and doc["memory"]["stored_bytes"] <= device.storage.capacity_bytes
    flash = plan_flash(doc)
    check_flash(flash)
    assert flash.packed and flash.flash_bytes <= device.storage.capacity_bytes
    assert any(offset % 65536 for offset in flash.offsets.values())  # units shared
    # the firmware's layout wears no more than the plan says at worst
    worst = schedule.erased_bytes_per_step()
    assert flash.lifetime_steps >= device.storage.endurance_cycles * device.storage.capacity_bytes // worst
    assert schedule.lifetime_steps() == device.storage.endurance_cycles * device.storage.capacity_bytes // worst


def test_a_wear_budget_on_a_packed_card_bounds_wear_not_occupancy():
    """Occupancy and wear are two rows: a wear budget binds on the units the page-outs touch, which
    on a packed card are far more than the sectors they occupy."""
    device, graph, ram = _many_small_tensors_case()
    free = solve(graph, device, ram=ram, mode="joint", time_limit=8, order="given")
    worn = free.erased_bytes_per_step()
    costs = node_costs(graph, device)
    paged = sorted(free.decisions.page_out)
    assert worn > 4 * float(costs.storage_bytes[paged].sum())
    endurance, capacity = device.storage.endurance_cycles, device.storage.capacity_bytes
    steps = endurance * capacity // (worn // 2)  # half the wear of the unbounded plan
    bounded = solve(graph, device, ram=ram, mode="joint", time_limit=8, order="given", min_lifetime_steps=steps)
    assert bounded.lifetime_steps() is None or bounded.lifetime_steps() >= steps
    assert bounded.erased_bytes_per_step() <= endurance * capacity // steps
    # Both solves stop at their time limit, so the free plan is no floor for the bounded one (a slower
    # machine searches less); the free problem's proven bound is, since a wear budget only removes plans.
    assert bounded.totals["energy_j"] >= free.solver["bound"] * (1 - 1e-9)
    doc = bounded.to_dict()
    validate(doc)
    # the validator counts the same wear on its own: one more page-out than allowed is refused
    doc["budgets"]["min_lifetime_steps"] = endurance * capacity // max(1, bounded.erased_bytes_per_step() - 1) + 1
    if bounded.erased_bytes_per_step():
        with pytest.raises(ScheduleInvalid, match="min_lifetime_steps"):
            validate(doc)


def test_storage_costs_follow_the_profile():
    device, graph, _ = _many_small_tensors_case()
    costs = node_costs(graph, device)
    sizes = np.array([n.bytes for n in graph.nodes])
    assert np.array_equal(costs.storage_bytes, -(-sizes // SECTOR_BYTES) * SECTOR_BYTES)
    assert np.all(costs.erased_bytes >= 65536 * (sizes > 0))
    nor = make_test_device(kind="spi-flash", erase_block_bytes=4096)
    costs = node_costs(graph, nor)
    assert np.array_equal(costs.storage_bytes, costs.erased_bytes)
    assert np.array_equal(costs.storage_bytes, -(-sizes // 4096) * 4096)


def test_behind_a_write_cache_a_page_out_wears_its_sectors():
    """Linux's page cache gathers writes into long sequential runs (rpi4's `write_cache: true`): the
    per-command worst case of a bare-metal card does not apply, and the validator counts the same."""
    for nbytes in (1, 512, 513, 70_000, 5 << 20):
        assert erased_bytes(nbytes, "sd-card", True, 4 << 20, write_cache=True) == -(-nbytes // 512) * 512
    device = make_test_device(capacity_bytes=16 * 65536, erase_block_bytes=65536, endurance_cycles=10_000,
                              write_cache=True)
    _, graph, ram = _many_small_tensors_case()
    schedule = solve(graph, device, ram=ram, mode="paging", time_limit=20, order="given")
    paged = sorted(schedule.decisions.page_out)
    assert paged and schedule.erased_bytes_per_step() == sum(-(-graph.nodes[i].bytes // 512) * 512 for i in paged)
    doc = schedule.to_dict()
    assert doc["device"]["write_cache"] is True
    lifetime = schedule.lifetime_steps()
    doc["budgets"]["min_lifetime_steps"] = lifetime
    validate(doc)
    doc["budgets"]["min_lifetime_steps"] = lifetime + 1  # one step more than the steps wear allows
    with pytest.raises(ScheduleInvalid, match="min_lifetime_steps"):
        validate(doc)
    assert plan_flash(doc).lifetime_steps == lifetime
