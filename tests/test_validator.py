"""The independent schedule validator, on hand-built schedules for a 5-node training chain."""

from __future__ import annotations

import ast
import inspect
import json

import pytest

from poet_opt.schedule import validator
from poet_opt.errors import PoetError
from poet_opt.schedule.validator import ScheduleInvalid, load_and_validate, replay, validate

# id, name, kind, bytes, deps, compute_s, compute_j. Paging costs scale with bytes (see _node).
NODES = [
    (0, "x", "forward", 1000, [], 0.001, 0.002),
    (1, "fc1", "forward", 2000, [0], 0.010, 0.020),
    (2, "loss", "loss", 10, [1], 0.002, 0.004),
    (3, "fc1_grad", "backward", 2000, [1, 2], 0.020, 0.040),
    (4, "w1_grad", "backward", 500, [0, 3], 0.010, 0.020),
]

# Steps as words: c=compute, o=page_out, i=page_in, f=free, followed by the node id.
# RAM after each compute/page_in: 1000, 3000, 3010, 5010, (free 2, 1) 3500 -> peak 5010.
PLAIN = "c0 c1 c2 c3 f2 f1 c4 f0 f3 f4"
# fc1 is dropped after the loss and recomputed for its gradient.
RECOMPUTE = "c0 c1 c2 f1 c1 c3 f2 f1 c4 f0 f3 f4"
# x goes to storage during the forward pass: peak 4010 instead of 5010.
PAGING = "c0 c1 o0 f0 c2 c3 f2 f1 i0 c4 f0 f3 f4"

PLAIN_TOTALS = {
    "energy_j": 0.086, "compute_j": 0.086, "page_in_j": 0.0, "page_out_j": 0.0, "runtime_s": 0.043,
    "peak_ram_bytes": 5010, "storage_bytes": 0, "computes": 5, "recomputes": 0, "page_ins": 0, "page_outs": 0,
    "storage_read_bytes": 0, "storage_written_bytes": 0,
}
RECOMPUTE_TOTALS = {**PLAIN_TOTALS, "energy_j": 0.106, "compute_j": 0.106, "runtime_s": 0.053,
                    "computes": 6, "recomputes": 1}
# page_out x: 0.001 s, 0.002 J; page_in x: 0.0005 s, 0.001 J.
PAGING_TOTALS = {**PLAIN_TOTALS, "energy_j": 0.089, "page_in_j": 0.001, "page_out_j": 0.002,
                 "runtime_s": 0.0445, "peak_ram_bytes": 4010, "storage_bytes": 1000, "page_ins": 1, "page_outs": 1,
                 "storage_read_bytes": 1000, "storage_written_bytes": 1000}

OPS = {"c": "compute", "o": "page_out", "i": "page_in", "f": "free"}


def _node(i, name, kind, size, deps, compute_s, compute_j):
    return {"id": i, "name": name, "kind": kind, "op": "", "bytes": size, "deps": deps, "flops": 0.0,
            "param_bytes": 0, "trainable": False, "compute_s": compute_s, "compute_j": compute_j,
            "page_out_s": size * 1e-6, "page_out_j": size * 2e-6, "page_in_s": size * 0.5e-6, "page_in_j": size * 1e-6}


def steps(words: str) -> list[dict]:
    return [{"op": OPS[w[0]], "node": int(w[1:])} for w in words.split()]


def schedule(words=PLAIN, totals=PLAIN_TOTALS, *, ram=10_000, runtime=1.0, storage=10_000, memory=True) -> dict:
    doc = {
        "format": "poet-opt/schedule@1", "generator": "hand", "model": "chain", "mode": "joint",
        "graph": {"name": "chain", "nodes": [_node(*n) for n in NODES]},
        "budgets": {"ram_bytes": ram, "runtime_s": runtime, "storage_bytes": storage},
        "steps": steps(words),
        "totals": dict(totals),
    }
    if memory:
        peak = totals["peak_ram_bytes"]
        doc["memory"] = {"param_bytes": 400, "param_grad_bytes": 400, "working_peak_bytes": peak,
                         "total_bytes": 800 + peak, "device_ram_bytes": 1 << 20, "fits_device": True}
    return doc


def invalid(doc, *needles):
    with pytest.raises(ScheduleInvalid) as info:
        validate(doc)
    assert info.value.exit_code == 1
    for needle in needles:
        assert needle in str(info.value)
    return info.value


def not_a_schedule(doc, *needles):
    with pytest.raises(PoetError) as info:
        validate(doc)
    assert not isinstance(info.value, ScheduleInvalid) and info.value.exit_code == 2
    for needle in needles:
        assert needle in str(info.value)


def assert_totals(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, int):
            assert got[key] == value and isinstance(got[key], int), key
        else:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


# --- valid schedules -------------------------------------------------------------------------

def test_plain_schedule_validates_with_hand_computed_totals():
    assert_totals(validate(schedule()), PLAIN_TOTALS)


def test_schedule_with_a_recompute_validates():
    assert_totals(validate(schedule(RECOMPUTE, RECOMPUTE_TOTALS)), RECOMPUTE_TOTALS)


def test_schedule_with_paging_validates_and_lowers_the_peak():
    assert_totals(validate(schedule(PAGING, PAGING_TOTALS, ram=4010, storage=1000)), PAGING_TOTALS)


def test_budgets_and_totals_are_met_within_tolerance():
    # runtime exactly at the budget, energy off by 1e-8 relative: both are rounding noise.
    totals = {**PLAIN_TOTALS, "energy_j": 0.086 * (1 + 1e-8)}
    validate(schedule(totals=totals, ram=5010, runtime=0.043, storage=0))


def test_memory_section_is_optional_and_null_budget_is_unbounded():
    validate(schedule(memory=False, runtime=None))


def test_replay_ignores_the_reported_totals():
    assert_totals(replay(schedule(totals={}, memory=False)), PLAIN_TOTALS)


# --- rule violations: ScheduleInvalid, exit 1 --------------------------------------------------

@pytest.mark.parametrize("words, needles", [
    ("c0 c2", ["step 1 (compute node 2 'loss')", "input 1 'fc1' is not resident"]),
    ("c0 c0", ["step 1 (compute node 0 'x')", "already resident"]),
    ("c0 f0 i0", ["step 2 (page_in node 0 'x')", "not on storage"]),
    ("c0 o0 i0", ["step 2 (page_in node 0 'x')", "already resident"]),
    ("c0 f1", ["step 1 (free node 1 'fc1')", "not resident"]),
    ("o0", ["step 0 (page_out node 0 'x')", "not resident"]),
], ids=["input-not-resident", "compute-while-resident", "page-in-never-paged-out", "page-in-while-resident",
        "free-not-resident", "page-out-not-resident"])
def test_step_rule_violations(words, needles):
    invalid(schedule(words), *needles)


def test_ram_over_budget():
    invalid(schedule(ram=5000), "step 3 (compute node 3 'fc1_grad')", "5,010 B", "ram_bytes 5,000 B")


def test_ram_over_budget_at_a_page_in():
    invalid(schedule("c0 c1 o0 f0 c2 i0", ram=3000), "step 5 (page_in node 0 'x')", "3,010 B",
            "ram_bytes 3,000 B")


def test_storage_over_budget():
    invalid(schedule(PAGING, PAGING_TOTALS, storage=999), "step 2 (page_out node 0 'x')", "1,000 B",
            "storage_bytes 999 B")


def test_paging_the_same_tensor_twice_uses_its_storage_once():
    validate(schedule("c0 o0 o0 f0 i0 f0 i0 c1 c2 c3 f2 f1 c4 f0 f3 f4", {
        **PLAIN_TOTALS, "energy_j": 0.092, "page_in_j": 0.002, "page_out_j": 0.004, "runtime_s": 0.046,
        "storage_bytes": 1000, "page_ins": 2, "page_outs": 2, "storage_read_bytes": 2000,
        "storage_written_bytes": 2000}, storage=1000))


def test_runtime_over_budget():
    invalid(schedule(runtime=0.04), "runtime 0.043 s", "runtime_s 0.04 s")


def test_node_never_computed():
    invalid(schedule("c0 c1 c2 c3 f2 f1 f0 f3"), "node 4 'w1_grad' is never computed")


def test_wrong_reported_energy():
    invalid(schedule(totals={**PLAIN_TOTALS, "energy_j": 0.052}),
            "totals.energy_j is 0.052 but the steps add up to 0.086")


def test_wrong_recompute_count():
    invalid(schedule(RECOMPUTE, {**RECOMPUTE_TOTALS, "recomputes": 0}),
            "totals.recomputes is 0 but the steps give 1")


def test_wrong_memory_section():
    doc = schedule()
    doc["memory"]["working_peak_bytes"] = 4000
    invalid(doc, "memory.working_peak_bytes", "4,000 B", "5,010 B")
    doc = schedule()
    doc["memory"]["total_bytes"] += 1
    invalid(doc, "memory.total_bytes", "5,811 B", "5,810 B")


def test_first_violation_wins():
    # The missing input at step 1 is reported, not the RAM budget broken at step 3 nor the bad totals.
    invalid(schedule("c0 c2 c1 c2 c3", totals={**PLAIN_TOTALS, "computes": 99}, ram=2000),
            "step 1 (compute node 2 'loss'): input 1 'fc1' is not resident")
    invalid(schedule("c1 c0", ram=10), "step 0 (compute node 1 'fc1'): input 0 'x' is not resident")


# --- not a schedule: plain PoetError, exit 2 ---------------------------------------------------

def test_wrong_format_string():
    doc = schedule()
    doc["format"] = "poet-opt/graph@1"
    not_a_schedule(doc, "'poet-opt/graph@1'", "poet-opt/schedule@1")
    del doc["format"]
    not_a_schedule(doc, "no 'format'")
    not_a_schedule([], "JSON object")


def test_format_of_another_version():
    doc = schedule()
    doc["format"] = "poet-opt/schedule@2"
    not_a_schedule(doc, "poet-opt/schedule@2", "version '2'", "supported format is 'poet-opt/schedule@1'")


def test_missing_section():
    doc = schedule()
    del doc["totals"]
    not_a_schedule(doc, "no 'totals' section")


def test_malformed_step():
    doc = schedule()
    doc["steps"][3] = ["compute", 3]
    not_a_schedule(doc, "step 3")


def test_unknown_op():
    doc = schedule()
    doc["steps"][1] = {"op": "swap", "node": 1}
    not_a_schedule(doc, "step 1 has unknown op 'swap'")


def test_node_id_out_of_range():
    doc = schedule()
    doc["steps"][4] = {"op": "compute", "node": 5}
    not_a_schedule(doc, "step 4 (compute) refers to node 5", "0..4")


def test_graph_not_topological():
    doc = schedule()
    doc["graph"]["nodes"][1]["deps"] = [2]
    not_a_schedule(doc, "node 1 'fc1' depends on node 2", "topological")
    doc = schedule()
    doc["graph"]["nodes"][1]["id"] = 7
    not_a_schedule(doc, "graph.nodes[1] has id 7", "index")


def test_structure_is_checked_before_any_rule():
    doc = schedule("c0 c2")
    doc["totals"]["computes"] = "five"
    not_a_schedule(doc, "totals.computes")


def test_schedule_invalid_is_a_poet_error_with_exit_code_1():
    assert issubclass(ScheduleInvalid, PoetError) and ScheduleInvalid.exit_code == 1


# --- files ---------------------------------------------------------------------------------------

def test_load_and_validate(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schedule()))
    doc, totals = load_and_validate(path)
    assert doc["format"] == "poet-opt/schedule@1"
    assert_totals(totals, PLAIN_TOTALS)


def test_load_names_the_file_on_every_failure(tmp_path):
    bad = schedule(ram=5000)
    cases = {"missing.json": None, "broken.json": "{not json", "over.json": json.dumps(bad)}
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(PoetError) as info:
            load_and_validate(path)
        assert str(path) in str(info.value) and "\n" not in str(info.value)


# --- independence --------------------------------------------------------------------------------

def test_the_validators_largest_quantity_is_the_loaders():
    from poet_opt import units

    assert validator.MAX_QUANTITY == units.MAX_QUANTITY


def test_validator_imports_nothing_from_poet_opt_but_errors_and_the_walk():
    """The validator and the walk it shares with the backends import nothing that made the plan."""
    from poet_opt.schedule import walk

    allowed = {validator: {"poet_opt.errors", "poet_opt.schedule.walk"}, walk: {"poet_opt.errors"}}
    for module, may in allowed.items():
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("poet_opt") for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                name = node.module or ""
                assert not node.level, f"relative import of {name!r}"
                assert not name.startswith("poet_opt") or name in may, (module.__name__, name)


# --- issue 28, 13: fields a hostile or careless file gets wrong -----------------------------

DEVICE = {"name": "board", "cpu": "Arm Cortex-M4", "ram_bytes": 262144, "bytes_per_element": 4, "alignment_bytes": 4,
          "storage_kind": "spi-flash", "storage_capacity_bytes": 1 << 24, "erase_block_bytes": 4096,
          "endurance_cycles": 100_000, "wear_levelling": False, "stack_reserve_bytes": 4096}


def with_device(**edits) -> dict:
    doc = schedule()
    doc["device"] = {**DEVICE, **edits}
    return doc


def test_a_sound_device_section_validates():
    validate(with_device())


@pytest.mark.parametrize("section, key, value, needles", [
    ("budgets", "ram_bytes", None, ("budgets.ram_bytes is null",)),
    ("device", "storage_capacity_bytes", -1, ("device.storage_capacity_bytes is -1", "non-negative integer")),
    ("budgets", "min_lifetime_steps", 1e30, ("budgets.min_lifetime_steps", "at most 2^63 - 1")),
    ("budgets", "min_lifetime_steps", 10**30, ("budgets.min_lifetime_steps", "at most 2^63 - 1")),
    ("budgets", "min_lifetime_steps", 0, ("budgets.min_lifetime_steps is 0",)),
    ("budgets", "min_lifetime_steps", 2.5, ("budgets.min_lifetime_steps", "integer")),
    ("device", "storage_kind", "tape", ("device.storage_kind is 'tape'", "spi-flash")),
    ("device", "erase_block_bytes", 0, ("device.erase_block_bytes is 0", "positive")),
    ("device", "endurance_cycles", "many", ("device.endurance_cycles",)),
    ("device", "wear_levelling", "yes", ("device.wear_levelling", "true or false")),
])
def test_malformed_budget_and_device_fields_are_refused_by_name(section, key, value, needles):
    doc = with_device()
    doc[section][key] = value
    not_a_schedule(doc, *needles)


def test_storage_kinds_are_the_profiles_kinds():
    # the validator keeps its own list (it imports nothing from the profiles): it must not drift
    import typing

    from poet_opt.device.profiles import Storage

    assert set(validator.STORAGE_KINDS) == set(typing.get_args(Storage.model_fields["kind"].annotation))
