"""Quick schedules without a solver: starting points for the MILP and baselines to beat.

Each returns formulation-style Decisions (or None when it cannot meet the budgets), so the same
step builder, replay and validator apply to them as to the optimum.
"""

from __future__ import annotations


from .costs import NodeCosts
from .formulation import Budgets, Decisions
from .graph import TrainingGraph
from .schedule import build_steps, plain_decisions, totals_of


def paging_decisions(graph: TrainingGraph, paged: set[int]) -> Decisions:
    """Plain training, except that each tensor in `paged` is written out right after it is made
    and read back in every stage that reads it, instead of being kept."""
    last = graph.last_use()
    users = graph.users()
    keep = set()
    page_in = set()
    for i in range(len(graph)):
        if i in paged:
            page_in.update((t, i) for t in users[i])
        else:
            keep.update((t, i) for t in range(i + 1, last[i] + 1))
    return Decisions(frozenset(), frozenset(page_in), frozenset(paged), frozenset(keep))


def _peak_stage(graph: TrainingGraph, steps: list[dict]) -> tuple[int, set[int]]:
    """Stage and resident set at the first moment RAM in use is at its peak."""
    resident: set[int] = set()
    first_done: set[int] = set()
    live = peak = 0
    at = (0, set())
    for step in steps:
        op, n = step["op"], step["node"]
        stage = len(first_done)
        if op in ("compute", "page_in"):
            resident.add(n)
            live += graph.nodes[n].bytes
            if live > peak:
                peak, at = live, (stage, set(resident))
            if op == "compute":
                first_done.add(n)
        elif op == "free":
            resident.discard(n)
            live -= graph.nodes[n].bytes
    return at


def _relieve_peak(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, decisions_for, candidate,
                  cost) -> Decisions | None:
    """Shared greedy loop: from plain training, while RAM peaks over budget, move the largest
    tensor that sits idle in the peak stage (and passes `candidate`, cheapest `cost` first on ties)
    into the chosen set, then rebuild the plan with `decisions_for(chosen)`. Fails when the peak
    stage holds nothing movable, or the plan breaks the runtime or storage budget."""
    chosen: set[int] = set()
    while True:
        decisions = decisions_for(chosen)
        steps = build_steps(graph, decisions)
        totals = totals_of(graph, costs, steps)
        if totals["peak_ram_bytes"] <= budgets.ram_bytes:
            break
        stage, resident = _peak_stage(graph, steps)
        busy = set(graph.nodes[stage].deps) | {stage}
        idle = [i for i in resident - busy - chosen if candidate(i)]
        if not idle:
            return None
        chosen.add(max(idle, key=lambda i: (graph.nodes[i].bytes, -cost(i))))
    if totals["runtime_s"] > budgets.runtime_s or totals["storage_bytes"] > budgets.storage_bytes:
        return None
    return decisions


def greedy_paging(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets) -> Decisions | None:
    """Page out the largest idle tensor at the RAM peak until the peak fits."""
    return _relieve_peak(graph, costs, budgets, lambda paged: paging_decisions(graph, paged),
                         candidate=lambda i: True, cost=lambda i: costs.page_out_j[i] + costs.page_in_j[i])


def checkpoint_decisions(graph: TrainingGraph, dropped: set[int]) -> Decisions:
    """Plain training, except that each forward tensor in `dropped` is freed once the forward pass
    no longer reads it, recomputed (with whatever it needs that is gone too) in the first later
    stage that reads it, and then kept until its last reader: segment-wise checkpointing."""
    nodes, users = graph.nodes, graph.users()
    last = graph.last_use()
    resident_until = {}  # i -> last stage in which i is resident (from its latest materialization)
    keep, recompute = set(), set()

    def hold(i, start):
        if i in dropped:
            forward_readers = [u for u in users[i] if not nodes[u].is_backward and u > start]
            end = max([start, *forward_readers]) if start == i else max(start, last[i])
        else:
            end = last[i]
        keep.update((t, i) for t in range(start + 1, end + 1))
        resident_until[i] = end

    for t in range(len(graph)):
        needed, stack = set(), [d for d in nodes[t].deps if resident_until.get(d, -1) < t]
        while stack:
            i = stack.pop()
            if i in needed:
                continue
            needed.add(i)
            stack.extend(d for d in nodes[i].deps if resident_until.get(d, -1) < t and d not in needed)
        for i in sorted(needed):
            recompute.add((t, i))
            hold(i, t)
        hold(t, t)
    return Decisions(frozenset(recompute), frozenset(), frozenset(), frozenset(keep))


def greedy_checkpointing(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets) -> Decisions | None:
    """Drop the largest idle forward tensor at the RAM peak from the checkpoints until the peak fits."""
    return _relieve_peak(graph, costs, budgets, lambda dropped: checkpoint_decisions(graph, dropped),
                         candidate=lambda i: not graph.nodes[i].is_backward, cost=lambda i: costs.compute_j[i])


def starting_points(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str) -> list[Decisions]:
    """Heuristic schedules valid for this mode and these budgets, cheapest first."""
    found = []
    plain = plain_decisions(graph)
    if graph.plain_peak_bytes() <= budgets.ram_bytes:
        found.append(plain)
    else:
        if mode in ("joint", "paging"):
            found.append(greedy_paging(graph, costs, budgets))
        if mode in ("joint", "remat"):
            found.append(greedy_checkpointing(graph, costs, budgets))
            found += _fitting_baselines(graph, costs, budgets)
        found = [d for d in found if d is not None]

    def energy(d):
        return totals_of(graph, costs, build_steps(graph, d))["energy_j"]

    return sorted(found, key=energy)


def _fitting_baselines(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets) -> list[Decisions]:
    """The DTR and sqrt(n) baselines' plans where they fit: the benchmark showed a time-limited
    solve ending above DTR's energy when the greedy starts were worse than it, and the solver
    must never lose to a baseline it could have started from."""
    from .baselines import dtr_decisions, sqrt_n_decisions, without_idle_keeps

    plans = [sqrt_n_decisions(graph), dtr_decisions(graph, costs, budgets.ram_bytes)]
    fitting = []
    for d in plans:
        if d is None:
            continue
        d = without_idle_keeps(graph, d)
        totals = totals_of(graph, costs, build_steps(graph, d))
        if totals["peak_ram_bytes"] <= budgets.ram_bytes and totals["runtime_s"] <= budgets.runtime_s:
            fitting.append(d)
    return fitting
