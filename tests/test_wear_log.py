"""A card that appends sequential writes (storage.sequential_writes, docs/wear.md): the firmware
writes each step's page-outs and weight write-backs as one log, the emulated card counts the
allocation units a write does not continue, and the planner predicts exactly that count."""

from __future__ import annotations

import numpy as np
import pytest

from poet_opt.device.media import au_rewrites, step_erased_bytes
from poet_opt.firmware.storage_model import Storage
from poet_opt.firmware.targets import Target

AU = 64 << 10  # small units, so that a short random stream crosses many


def _card(sequential: bool) -> Storage:
    return Storage(Target("cortex-m4f", 64 << 10, storage_kind="sd-card", storage_capacity_bytes=4 << 20,
                          erase_block_bytes=AU, sequential_writes=sequential))


def test_the_emulated_card_and_the_rule_count_the_same_rewrites():
    rng = np.random.default_rng(5)
    card, open_unit, worn = _card(True), None, 0
    at = 0
    for _ in range(400):
        # mostly appends (some across unit boundaries), sometimes a jump elsewhere
        length = int(rng.integers(1, 300)) * 512
        if rng.random() < 0.2 or at + length > 4 << 20:
            at = int(rng.integers(0, (3 << 20) // 512)) * 512
        assert card.device_write(at, np.zeros(length, np.uint8)) == 0
        units, open_unit = au_rewrites(at, length, AU, open_unit)
        worn += units
        at += length
    assert card.stats().erases_total == worn > 0


def test_a_sequential_log_wears_the_units_it_fills_and_a_command_card_every_unit_per_command():
    sizes = [3 * 512 + 100, 70 << 10, 512, 5000, 130 << 10]  # some end inside a sector
    for sequential in (False, True):
        card, at = _card(sequential), AU  # the log starts on a unit boundary
        for _ in range(3):  # steps: the log is written again from its start
            before, at = card.stats(), AU
            for nbytes in sizes:  # poet_page_out's commands: whole sectors, then the partial last one
                whole = nbytes // 512 * 512
                if whole:
                    card.device_write(at, np.zeros(whole, np.uint8))
                if nbytes > whole:
                    card.device_write(at + whole, np.zeros(512, np.uint8))
                at += -(-nbytes // 512) * 512
            step = card.stats().since(before).erases_total * AU
        sectors = sum(-(-n // 512) * 512 for n in sizes)
        if sequential:
            assert step == step_erased_bytes(sectors, AU, True) == 4 * AU  # 207 KiB of sectors: 4 units
        else:
            assert step > 4 * AU  # every command rewrites the units it touches


@pytest.mark.parametrize("sequential", [True, False], ids=["log", "per-command"])
def test_the_emulated_card_wears_what_the_plan_predicts(tmp_path_factory, sequential):
    """A paging plan with streamed weights on the nRF52840's card, emulated: the allocation units
    the card counts rewritten per step are the schedule's erased_bytes_per_step, exactly, on the
    card that appends sequential writes; on one that may rewrite every unit each command touches,
    no more than the schedule's worst case, and what the flash plan counts where the tensors lie."""
    pytest.importorskip("torch")
    pytest.importorskip("unicorn")
    pytest.importorskip("ziglang")
    from pathlib import Path

    from poet_opt.device.profiles import load_profile
    from poet_opt.firmware.arena import plan_flash
    from poet_opt.firmware.trainer import emulate_training

    device = "nrf52840"
    if not sequential:
        text = Path(load_profile("nrf52840").source).read_text()
        device = tmp_path_factory.mktemp("profile") / "nrf52840-per-command.yaml"
        device.write_text(text.replace("sequential_writes: true", "sequential_writes: false"))
        device = str(device)
    rng = np.random.default_rng(1)
    data = tmp_path_factory.mktemp("data") / "mlp.npz"
    np.savez(data, x=rng.standard_normal((32, 160)).astype(np.float32), y=np.arange(32) % 10)
    steps = 3
    result = emulate_training(torch_model="poet_opt.examples.torch_models:wide_mlp", input_shape="32,160",
                              device=device, ram="96KiB", steps=steps, lr=0.05, data=data, weights="streamed",
                              mode="paging", tile_bytes="16KiB", time_limit=20)
    schedule = result.schedule
    storage = schedule.profile.storage
    assert storage.sequential_writes == sequential and not storage.write_cache
    doc = schedule.to_dict()
    assert doc["totals"]["page_outs"] > 0  # activations are paged, beside the weights written back
    flash = plan_flash(doc)
    predicted = schedule.erased_bytes_per_step()
    worn = result.flash_wear_events * storage.erase_block_bytes
    if not sequential:
        assert not flash.log and worn <= steps * predicted
        assert result.flash_lifetime_steps == storage.endurance_cycles * storage.capacity_bytes * steps // worn
        return
    assert flash.log and flash.offsets[flash.log[0]] % storage.erase_block_bytes == 0
    assert worn == steps * predicted
    # the log's sectors, rounded up to whole units: what the planner's closed form says
    nodes, au = doc["graph"]["nodes"], storage.erase_block_bytes
    written = [s["node"] for s in doc["steps"] if s["op"] == "page_out"]
    written += [p for s in doc["steps"] if s["op"] == "compute" for p in nodes[s["node"]].get("updates", ())]
    sectors = sum(-(-nodes[n]["bytes"] // 512) * 512 for n in written)
    assert predicted == -(-sectors // au) * au
    assert result.flash_lifetime_steps == schedule.lifetime_steps()


def _small_card_case(**storage):
    from conftest import make_test_device

    from poet_opt.model.random_graph import random_training_graph

    device = make_test_device(**{"capacity_bytes": 16 * 65536, "erase_block_bytes": 65536, "endurance_cycles": 10_000,
                                 **storage})
    graph = random_training_graph(40, 7)
    ram = int(graph.min_working_set_bytes() + 0.1 * (graph.plain_peak_bytes() - graph.min_working_set_bytes()))
    return device, graph, ram


def test_a_binding_wear_budget_states_its_energy_cost_from_two_solves():
    from poet_opt.schedule.report import summary_text
    from poet_opt.solver.driver import solve

    device, graph, ram = _small_card_case()
    free = solve(graph, device, ram=ram, mode="joint", time_limit=3, order="given")
    steps = device.storage.endurance_cycles * device.storage.capacity_bytes // (free.erased_bytes_per_step() // 2)
    bounded = solve(graph, device, ram=ram, mode="joint", time_limit=12, order="given", min_lifetime_steps=steps)
    wear = bounded.solver["wear_budget"]
    assert wear["binds"] and wear["solves"] == 2 and wear["lifetime_without"] < steps
    assert wear["cost_j"] == pytest.approx(bounded.totals["energy_j"] - wear["energy_without_j"])
    assert bounded.lifetime_steps() is None or bounded.lifetime_steps() >= steps
    assert "wear cost" in summary_text(bounded) and "two solves sharing the time limit" in summary_text(bounded)


def test_a_wear_budget_that_cannot_bind_costs_nothing_in_one_solve():
    from poet_opt.schedule.report import summary_text
    from poet_opt.schedule.validator import validate
    from poet_opt.solver.driver import solve

    device, graph, ram = _small_card_case(sequential_writes=True)
    schedule = solve(graph, device, ram=ram, mode="joint", time_limit=3, order="given", min_lifetime_steps=10)
    wear = schedule.solver["wear_budget"]
    assert not wear["binds"] and wear["solves"] == 1 and wear["cost_j"] == 0
    assert "wear cost none: the budget of 10 steps cannot bind" in summary_text(schedule)
    validate(schedule.to_dict())


def test_the_validator_counts_a_sequential_log_in_whole_units():
    from poet_opt.schedule.validator import ScheduleInvalid, validate
    from poet_opt.solver.driver import solve

    device, graph, ram = _small_card_case(sequential_writes=True)
    schedule = solve(graph, device, ram=ram, mode="paging", time_limit=6, order="given")
    doc = schedule.to_dict()
    assert doc["device"]["sequential_writes"] is True and schedule.decisions.page_out
    sectors = sum(-(-graph.nodes[i].bytes // 512) * 512 for i in schedule.decisions.page_out)
    assert schedule.erased_bytes_per_step() == step_erased_bytes(sectors, 65536, True)
    lifetime = schedule.lifetime_steps()
    doc["budgets"]["min_lifetime_steps"] = lifetime
    validate(doc)
    doc["budgets"]["min_lifetime_steps"] = lifetime + 1
    with pytest.raises(ScheduleInvalid, match="min_lifetime_steps"):
        validate(doc)


def test_a_wear_budget_no_plan_meets_names_the_plan_without_it():
    from poet_opt.errors import PoetError
    from poet_opt.solver.driver import solve

    device, graph, ram = _small_card_case(kind="spi-flash", erase_block_bytes=4096)
    # beyond raw flash's endurance: no page-out at all, and paging mode cannot do without
    with pytest.raises(PoetError, match=r"without --min-lifetime-steps the plan uses .* and lasts 10,000 steps"):
        solve(graph, device, ram=ram, mode="paging", time_limit=3, order="given", min_lifetime_steps=20_000)
