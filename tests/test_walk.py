"""The one walk of a schedule's steps (poet_opt/schedule/walk.py), which the validator, the firmware
generator and the PyTorch executors all follow (issue 27: one replay that every backend walks)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poet_opt.schedule.walk import ScheduleInvalid, Step, walk

# x -> w (weights) -> y = f(x, w); g = grad(y) reads y and w and updates w
NAMES = ["x", "param:w", "y", "grad:y"]
DEPS = [[], [], [0, 1], [2, 1]]
UPDATES = [[], [], [], [1]]


def steps_of(*text: str) -> list[tuple[str, int]]:
    return [(op, NAMES.index(name)) for op, name in (s.split() for s in text)]


def walked(*text: str, complete: bool = True) -> list[Step]:
    return list(walk(steps_of(*text), DEPS, UPDATES, NAMES, complete=complete))


def test_the_walk_marks_first_computes_and_first_copies_on_storage():
    got = walked("compute x", "compute param:w", "compute y", "page_out y", "free y", "page_in y", "page_out y",
                 "free y", "compute y", "compute grad:y")
    assert [(s.op, NAMES[s.node], s.first) for s in got] == [
        ("compute", "x", True), ("compute", "param:w", True), ("compute", "y", True), ("page_out", "y", True),
        ("free", "y", False), ("page_in", "y", False), ("page_out", "y", False), ("free", "y", False),
        ("compute", "y", False), ("compute", "grad:y", True)]
    assert [s.index for s in got] == list(range(10))


@pytest.mark.parametrize("steps, message", [
    (("compute y",), "step 0 (compute node 2 'y'): input 0 'x' is not resident"),
    (("compute x", "compute x"), "step 1 (compute node 0 'x'): the node is already resident"),
    (("compute x", "page_in x"), "step 1 (page_in node 0 'x'): the node is not on storage"),
    (("compute x", "page_out x", "page_in x"), "step 2 (page_in node 0 'x'): the node is already resident"),
    (("page_out x",), "step 0 (page_out node 0 'x'): the node is not resident"),
    (("compute x", "free x", "free x"), "step 2 (free node 0 'x'): the node is not resident"),
    (("compute x", "compute param:w", "compute y", "compute grad:y", "free y", "compute y"),
     "step 5 (compute node 2 'y'): it reads the weights 1 'param:w' after node 3 'grad:y' updated them in place"),
    (("compute x", "compute param:w", "compute y", "compute grad:y", "free grad:y", "compute grad:y"),
     "step 5 (compute node 3 'grad:y'): it reads the weights 1 'param:w' after node 3 'grad:y'"),
    (("compute x", "compute param:w", "compute y"), "node 3 'grad:y' is never computed"),
    (("compute x", "spill x"), "step 1 (spill node 0 'x'): unknown op"),
])
def test_a_step_no_backend_can_run_is_refused_naming_it(steps, message):
    with pytest.raises(ScheduleInvalid) as err:
        walked(*steps)
    assert message in str(err.value)
    assert err.value.exit_code == 1


def test_a_prefix_of_a_schedule_walks_without_every_node():
    assert [s.op for s in walked("compute x", "compute param:w", complete=False)] == ["compute", "compute"]


def test_the_walk_is_lazy_so_a_backend_acts_on_every_step_before_the_bad_one():
    seen = []
    with pytest.raises(ScheduleInvalid, match="step 2"):
        for step in walk(steps_of("compute x", "free x", "free x"), DEPS, UPDATES, NAMES):
            seen.append(step.op)
    assert seen == ["compute", "free"]


@st.composite
def chains(draw):
    """A chain of n nodes, each reading the one before, and a random valid schedule of it: every
    node computed in order, with random frees, page-outs, page-ins and recomputes on the way."""
    n = draw(st.integers(2, 6))
    deps = [[]] + [[k - 1] for k in range(1, n)]
    steps, resident, stored = [], set(), set()
    for k in range(n):
        for _ in range(draw(st.integers(0, 3))):
            choice = draw(st.sampled_from(["free", "page_out", "page_in", "recompute"]))
            pool = sorted(resident) if choice in ("free", "page_out") else sorted(stored - resident) \
                if choice == "page_in" else [j for j in range(k) if j not in resident
                                             and all(d in resident for d in deps[j])]
            if not pool:
                continue
            j = draw(st.sampled_from(pool))
            steps.append(("compute" if choice == "recompute" else choice, j))
            {"free": resident.discard, "page_out": stored.add, "page_in": resident.add,
             "recompute": resident.add}[choice](j)
        bring(k, deps, steps, resident, stored)
    return deps, steps


def bring(k, deps, steps, resident, stored):
    """Node k into RAM: paged in if it has a copy on storage, else (re)computed, its inputs first."""
    if k in resident:
        return
    if k in stored:
        steps.append(("page_in", k))
    else:
        for d in deps[k]:
            bring(d, deps, steps, resident, stored)
        steps.append(("compute", k))
    resident.add(k)


@settings(max_examples=200, deadline=None)
@given(chains(), st.data())
def test_the_walk_accepts_valid_schedules_and_refuses_a_dropped_step_only_as_invalid(case, data):
    deps, steps = case
    names = [f"n{k}" for k in range(len(deps))]
    got = list(walk(steps, deps, [[] for _ in deps], names))
    firsts = [s.first for s in got if s.op == "compute"]
    seen = set()
    assert firsts == [not (n in seen or seen.add(n)) for op, n in steps if op == "compute"]
    # a schedule with one step taken out either still runs or is refused by the walk, nothing else
    k = data.draw(st.integers(0, len(steps) - 1))
    try:
        list(walk(steps[:k] + steps[k + 1:], deps, [[] for _ in deps], names))
    except ScheduleInvalid as exc:
        assert str(exc).startswith(("step ", "node "))


def test_the_validator_the_firmware_and_the_executor_refuse_a_bad_schedule_with_one_line():
    """A strip plan with its weights streamed, altered to recompute a node after it has updated
    weights in place: every consumer walks the same steps, so each refuses it the same way."""
    torch = pytest.importorskip("torch")
    from poet_opt.executor.tiled import TiledExecutor
    from poet_opt.executor.train import lower_for_run
    from poet_opt.firmware import arena, codegen
    from poet_opt.schedule import validator
    from poet_opt.solver.driver import solve

    network = lower_for_run("poet_opt.examples.torch_models:strip_cnn", "1,1,96,96", ram_bytes=160 * 1024,
                            device_ram_bytes=262144, stack_reserve_bytes=4096)
    doc = solve(network.graph, "nrf52840", ram=160 * 1024, time_limit=5).to_dict()
    nodes = doc["graph"]["nodes"]
    k = next(k for k, s in enumerate(doc["steps"]) if s["op"] == "compute" and nodes[s["node"]]["updates"])
    n = doc["steps"][k]["node"]
    bad = copy.deepcopy(doc)
    bad["steps"][k + 1:k + 1] = [{"op": "free", "node": n}, {"op": "compute", "node": n}]
    want = f"step {k + 2} (compute node {n} {nodes[n]['name']!r}): it reads the weights"

    messages = []
    for consumer in (lambda: validator.replay(bad),
                     lambda: TiledExecutor(network, bad, lr=0.05),
                     lambda: codegen.generate(network, bad, arena.plan_arena(bad), arena.plan_flash(bad), steps=1,
                                              lr=0.05, x=np.zeros((1, 1, 96, 96), np.float32),
                                              y=np.zeros(1, np.int64))):
        with pytest.raises(ScheduleInvalid) as err:
            consumer()
        messages.append(str(err.value))
    assert all(want in m for m in messages), messages
    assert len(set(messages)) == 1
    with TiledExecutor(network, doc, lr=0.05) as ok:  # the plan itself runs
        assert np.isfinite(ok(torch.zeros(1, 1, 96, 96), torch.tensor([1])))
