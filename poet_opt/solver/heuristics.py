"""Quick schedules without a solver: starting points for the MILP and baselines to beat.

Each returns formulation-style Decisions (or None when it cannot meet the budgets), so the same
step builder, replay and validator apply to them as to the optimum.
"""

from __future__ import annotations

import math
import time
from typing import Optional

from poet_opt.device.costs import NodeCosts
from poet_opt.errors import DeadlinePassed
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import (Budgets, Decisions, Keep, build_steps, paged_erased_bytes,
                                         paged_region_bytes, plain_decisions, storage_limits, totals_of)
from poet_opt.solver.backends import interrupted
from poet_opt.solver.baselines import dtr_decisions, sqrt_n_decisions, without_idle_keeps
from poet_opt.solver.checkpointing import checkpoint_decisions
from poet_opt.solver.rebuild import rebuild_paged


def paging_decisions(graph: TrainingGraph, paged: set[int]) -> Decisions:
    """Plain training, except that each tensor in `paged` is written out right after it is made
    and read back in every stage that reads it, instead of being kept."""
    last = graph.last_use()
    users = graph.users()
    keep = {}
    page_in = set()
    for i in range(len(graph)):
        if i in paged:
            page_in.update((t, i) for t in users[i])
        elif last[i] > i:
            keep[i] = ((i + 1, last[i]),)
    return Decisions(frozenset(), frozenset(page_in), frozenset(paged), Keep(keep))


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
                  cost, deadline: Optional[float] = None) -> Decisions | None:
    """Shared greedy loop: from plain training, while RAM peaks over budget, move the largest
    tensor that sits idle in the peak stage (and passes `candidate`, cheapest `cost` first on ties)
    into the chosen set, then rebuild the plan with `decisions_for(chosen)`. Fails when the peak
    stage holds nothing movable, the plan breaks the runtime or storage budget, or
    ``time.perf_counter()`` passes ``deadline`` (each round replays the whole plan)."""
    chosen: set[int] = set()
    while True:
        if interrupted():  # Ctrl-C: the MILP phase after this one reports what was found
            return None
        if deadline is not None and time.perf_counter() > deadline:
            return None
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


def greedy_paging(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets,
                  deadline: Optional[float] = None) -> Decisions | None:
    """Page out the largest idle tensor at the RAM peak until the peak fits."""
    return _relieve_peak(graph, costs, budgets, lambda paged: paging_decisions(graph, paged),
                         candidate=lambda i: True, cost=lambda i: costs.page_out_j[i] + costs.page_in_j[i],
                         deadline=deadline)


def greedy_checkpointing(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets,
                         deadline: Optional[float] = None) -> Decisions | None:
    """Drop the largest idle forward tensor at the RAM peak from the checkpoints until the peak fits."""
    return _relieve_peak(graph, costs, budgets, lambda dropped: checkpoint_decisions(graph, dropped),
                         candidate=lambda i: not graph.nodes[i].is_backward, cost=lambda i: costs.compute_j[i],
                         deadline=deadline)


def farthest_use_paging(graph: TrainingGraph, budgets: Budgets) -> Decisions | None:
    """Plain order, each stage holding what it reads; what does not fit into the next stage waits
    on storage, the largest read farthest ahead first (after Belady's rule): weights and the input are
    read again from storage, anything else is paged out once and in where it is read. It fits any
    budget that holds every node's working set, in one linear pass: the start for graphs too large
    for the replaying greedy loops (activation strips make thousands of nodes) where no other fits."""
    nodes = graph.nodes
    size = [n.bytes for n in nodes]
    reread = [n.op in ("input", "param") for n in nodes]
    uses: list[list[int]] = [[] for _ in nodes]
    for n in nodes:
        for d in set(n.deps):
            uses[d].append(n.id)
    pointer = [0] * len(nodes)  # index of the next use in uses[i]

    def next_use(i: int, after: int) -> int | None:
        u = uses[i]
        while pointer[i] < len(u) and u[pointer[i]] <= after:
            pointer[i] += 1
        return u[pointer[i]] if pointer[i] < len(u) else None

    recompute, page_in, page_out, keep = set(), set(), set(), set()
    kept: set[int] = set()
    for t, node in enumerate(nodes):
        deps = set(node.deps)
        for i in deps - kept:
            (recompute if reread[i] else page_in).add((t, i))
            if not reread[i]:
                page_out.add(i)
        if sum(size[i] for i in kept | deps | {t}) > budgets.ram_bytes:
            return None
        if t + 1 == len(nodes):
            break
        wanted = set(nodes[t + 1].deps)
        room = budgets.ram_bytes - sum(size[i] for i in wanted - (kept | deps | {t})) - size[t + 1]
        ahead = sorted((_keep_rank(next_use(i, t) - t, size[i]), i)
                       for i in kept | deps | {t} if next_use(i, t) is not None)
        kept = set()
        for _, i in ahead:
            if size[i] <= room:
                kept.add(i)
                room -= size[i]
            elif not reread[i]:
                page_out.add(i)
        keep.update((t + 1, i) for i in kept)
    return Decisions(frozenset(recompute), frozenset(page_in), frozenset(page_out), frozenset(keep))


def _keep_rank(distance: int, nbytes: int) -> tuple:
    """Which tensors stay for the next stage first: what it reads, then the least bytes times
    stages held. On raw flash every paged tensor takes a whole erase block however small it is, so
    holding many small tensors and paging a few large ones keeps the plan within the storage."""
    return (0, 0) if distance == 1 else (1, nbytes * distance)


REPLAYING_GREEDY_MAX_NODES = 600
# gap_plan scores every gap over the peak stage at each step: 13 s at 4000 nodes, hours at 100,000.
# Past this size spill_plan (linear) is the start.
GAP_PLAN_MAX_NODES = 20_000


def starting_points(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, mode: str,
                    deadline: Optional[float] = None, good_enough: Optional[float] = None) -> list[Decisions]:
    """Heuristic schedules valid for this mode and these budgets, cheapest first. Past ``deadline``
    (a ``time.perf_counter()`` value) the slow greedy loops give up and are left out: a time limit
    is a promise, and the MILP after them needs the time. A paging start at most ``good_enough``
    joules (plain training's floor within the gap asked for) is proven good enough: it alone."""

    def late() -> bool:
        return interrupted() or (deadline is not None and time.perf_counter() > deadline)

    found = []
    if graph.plain_peak_bytes() <= budgets.ram_bytes:
        found.append(plain_decisions(graph))
    else:
        paging = mode in ("joint", "paging")
        if paging:  # tenths of a second at 10,000 nodes: first, so that a plan exists at any size
            spill = spill_plan(graph, costs, budgets, deadline)
            if spill is not None and mode == "joint" and not late():
                # it pages every activation it drops; many are cheaper rebuilt where they are read
                spill = rebuild_paged(graph, costs, budgets, spill, deadline)[0]
            found.append(spill)
            if good_enough is not None and _admissible(graph, costs, budgets, spill) and \
                    plan_energy_j(graph, costs, spill) <= good_enough and plan_runtime_s(costs, spill) <= budgets.runtime_s:
                return [spill]
        if mode != "none" and len(graph) <= GAP_PLAN_MAX_NODES and not late():
            found.append(gap_plan(graph, costs, budgets, allow_paging=paging,
                                  allow_remat=mode in ("joint", "remat"), deadline=deadline))
        # The replaying greedy loops re-run the whole plan per step: minutes at 1000 nodes, where
        # gap_plan alone takes seconds.
        small = len(graph) <= REPLAYING_GREEDY_MAX_NODES
        if paging and small and not late():
            found.append(greedy_paging(graph, costs, budgets, deadline))
        remat = mode in ("joint", "remat") and not interrupted()
        if remat and small and not late():
            found.append(greedy_checkpointing(graph, costs, budgets, deadline))
        # the greedy pagers do not count storage: a plan over the storage budget (a wear budget
        # makes it small) is no start at all; nor is one that runs on weights after their update
        found = [d for d in found if _admissible(graph, costs, budgets, d)]
        if not found and mode in ("joint", "paging"):  # the last resort, where nothing else fits
            found = [d for d in [farthest_use_paging(graph, budgets)] if _admissible(graph, costs, budgets, d)
                     and plan_runtime_s(costs, d) <= budgets.runtime_s]
        if remat and (small or not late()):
            # the baselines take one replay each, and the solver must never end above one that fits
            # (tests/test_baselines.py): kept past the deadline on small graphs, where they take
            # milliseconds; on large ones DTR alone scans what is resident at every stage (minutes
            # at 10,000 nodes) and the time limit comes first
            usable = [d for d in found if plan_runtime_s(costs, d) <= budgets.runtime_s]
            beat = min((plan_energy_j(graph, costs, d) for d in usable), default=None)
            found += [d for d in _fitting_baselines(graph, costs, budgets, beat=beat,
                                                    deadline=None if small else deadline)
                      if _admissible(graph, costs, budgets, d)]

    return sorted(found, key=lambda d: plan_energy_j(graph, costs, d))


def _admissible(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, decisions: Decisions | None) -> bool:
    return (decisions is not None and fits_storage(costs, budgets, decisions)
            and not recomputes_after_update(graph, decisions))


def plan_energy_j(graph: TrainingGraph, costs: NodeCosts, decisions: Decisions) -> float:
    """totals_of(build_steps(...))["energy_j"] to the last bit, without the replay (4-7 s at 2000
    nodes): the steps hold one compute per node and per recomputation, one page-in per page-in and
    one page-out per page-out, and math.fsum is exactly rounded in any order."""
    cj = math.fsum([*map(float, costs.compute_j), *(float(costs.compute_j[i]) for _, i in decisions.recompute)])
    ij = math.fsum(float(costs.page_in_j[i]) for _, i in decisions.page_in)
    oj = math.fsum(float(costs.page_out_j[i]) for i in decisions.page_out)
    return math.fsum([cj, ij, oj])


def plan_runtime_s(costs: NodeCosts, decisions: Decisions) -> float:
    """totals_of(build_steps(...))["runtime_s"], without the replay (as plan_energy_j)."""
    return math.fsum([*map(float, costs.compute_s), *(float(costs.compute_s[i]) for _, i in decisions.recompute),
                      *(float(costs.page_in_s[i]) for _, i in decisions.page_in),
                      *(float(costs.page_out_s[i]) for i in decisions.page_out)])


def recomputes_after_update(graph: TrainingGraph, decisions: Decisions) -> bool:
    """Whether a plan reads streamed weights, or runs a layer on them, after their in-place update
    (the baselines and greedy loops do not know about updates; such a plan would train wrongly)."""
    if not graph.streams_weights:
        return False
    cap = graph.last_compute_stage()
    return any(t > cap[i] for t, i in decisions.recompute)


def fits_storage(costs: NodeCosts, budgets: Budgets, decisions: Decisions) -> bool:
    """The paged tensors within the storage budget: the space they occupy and the wear they cost."""
    paged = list(decisions.page_out)
    return all(float(per_tensor[paged].sum()) <= limit * (1 + 1e-12)
               for per_tensor, limit in storage_limits(costs, budgets))


def _fitting_baselines(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets,
                       beat: Optional[float] = None, deadline: Optional[float] = None) -> list[Decisions]:
    """The DTR and sqrt(n) baselines' plans where they fit: the benchmark showed a time-limited
    solve ending above DTR's energy when the greedy starts were worse than it, and the solver
    must never lose to a baseline it could have started from. ``beat``: the energy of a fitting
    start in hand; a baseline that costs no less cannot lower it and is not replayed (the replays
    took 25 s at 2000 nodes)."""
    def late() -> bool:
        return interrupted() or (deadline is not None and time.perf_counter() > deadline)

    plans = []
    try:
        plans.append(None if late() else sqrt_n_decisions(graph, deadline=deadline))
    except DeadlinePassed:
        pass
    plans.append(None if late() else dtr_decisions(graph, costs, budgets.ram_bytes, deadline=deadline))
    fitting = []
    for d in plans:
        if d is None or (beat is not None and plan_energy_j(graph, costs, d) >= beat):
            continue
        d = without_idle_keeps(graph, d)
        try:  # sqrt(n)'s plan at 10^5 nodes replays for 14 s, past any deadline a 30 s limit sets
            totals = totals_of(graph, costs, build_steps(graph, d, deadline=deadline))
        except DeadlinePassed:
            continue
        if totals["peak_ram_bytes"] <= budgets.ram_bytes and totals["runtime_s"] <= budgets.runtime_s:
            fitting.append(d)
    return fitting


def gap_plan(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, *, allow_paging: bool = True,
             allow_remat: bool = True, deadline: Optional[float] = None) -> Decisions | None:
    """Plain training, except that a tensor may leave RAM in a *gap* between two stages that touch
    it (make or read it), and come back for the stage after the gap: paged in (it is paged out once,
    right after it is made), or recomputed there when it is a forward node whose inputs are all in
    RAM in that stage anyway (they are then pinned there). While RAM peaks over budget, drop the gap
    over the peak stage that frees the most bytes per joule, by its cheaper way back; then put back,
    dearest first, every dropped gap that still fits.

    Finer than greedy_paging (which pages a tensor in for every reader, even the forward reader right
    after it) and fast at any size: recomputed nodes only read resident inputs, so RAM in use within
    a stage peaks when its own node runs, and the plan's peak is the largest per-stage sum of resident
    tensors, kept in one array and updated per dropped gap. The plan is replayed once at the end, so a
    mismatch fails safely (None); so does passing ``deadline``."""
    import numpy as np

    nodes, T = graph.nodes, len(graph)
    size = np.array([n.bytes for n in nodes], dtype=np.int64)
    users, last = graph.users(), graph.last_use()
    live = np.zeros(T + 1, dtype=np.int64)
    for i in range(T):
        live[i] += size[i]
        live[last[i] + 1] -= size[i]
    live = np.cumsum(live)[:T]
    if live.max(initial=0) <= budgets.ram_bytes:
        return plain_decisions(graph)
    owner, gap_a, gap_b = read_gaps(graph, users)
    n_gaps = len(owner)
    how = np.zeros(n_gaps, dtype=np.int8)  # 0 kept, 1 paged in after the gap, 2 recomputed after it
    paged_out = np.zeros(T, dtype=bool)
    gap_bytes = size[owner].astype(float)
    page_in_j, page_out_j = costs.page_in_j[owner], costs.page_out_j[owner]
    away: dict[int, list[tuple[int, int]]] = {}  # tensor -> dropped gaps (a, b)
    pins: dict[int, list[int]] = {}  # tensor -> stages in which a recomputation reads it

    def resident(d, t):
        return d <= t <= last[d] and not any(a < t < b for a, b in away.get(d, ()))

    cap = graph.last_compute_stage() if graph.streams_weights else None

    def recomputable(i, b):
        return ((allow_remat or nodes[i].op == "param") and not nodes[i].is_backward
                and (cap is None or b <= cap[i]) and all(resident(d, b) for d in nodes[i].deps))

    while True:
        if interrupted() or (deadline is not None and time.perf_counter() > deadline):
            return None  # no plan yet: the loop only stops once the peak fits
        t = int(np.argmax(live))
        if live[t] <= budgets.ram_bytes:
            break
        cand = np.flatnonzero((how == 0) & (gap_a < t) & (t < gap_b))
        best = None
        for g in cand.tolist():
            i, a, b = int(owner[g]), int(gap_a[g]), int(gap_b[g])
            if any(a < p < b for p in pins.get(i, ())):
                continue
            options = []
            if allow_paging:
                options.append((page_in_j[g] + (0.0 if paged_out[i] else page_out_j[g]), 1))
            if recomputable(i, b):
                options.append((float(costs.compute_j[i]), 2))
            for joules, way in options:
                score = (gap_bytes[g] / joules if joules > 0 else np.inf, gap_bytes[g])
                if best is None or score > best[0]:
                    best = (score, g, way)
        if best is None:
            return None
        _, g, way = best
        i, a, b = int(owner[g]), int(gap_a[g]), int(gap_b[g])
        how[g] = way
        away.setdefault(i, []).append((a, b))
        if way == 1:
            paged_out[i] = True
        else:
            for d in nodes[i].deps:
                pins.setdefault(d, []).append(b)
        live[a + 1:b] -= size[i]
    # Undo drops the budget no longer needs, dearest first.
    dropped = np.flatnonzero(how > 0).tolist()
    dearest = sorted(dropped, key=lambda g: -(page_in_j[g] if how[g] == 1 else costs.compute_j[owner[g]]))
    for g in dearest:
        a, b, i = int(gap_a[g]), int(gap_b[g]), int(owner[g])
        if live[a + 1:b].max(initial=0) + size[i] <= budgets.ram_bytes:
            how[g] = 0
            away[i].remove((a, b))
            live[a + 1:b] += size[i]
    page_in, recompute, page_out = set(), set(), set()
    for g in np.flatnonzero(how > 0).tolist():
        i, b = int(owner[g]), int(gap_b[g])
        if how[g] == 1:
            page_in.add((b, i))
            page_out.add(i)
        else:
            recompute.add((b, i))
    keep = Keep({i: _without(i + 1, last[i], away.get(i, ())) for i in range(T)})
    decisions = Decisions(frozenset(recompute), frozenset(page_in), frozenset(page_out), keep)
    totals = totals_of(graph, costs, build_steps(graph, decisions))
    if (totals["peak_ram_bytes"] > budgets.ram_bytes or totals["runtime_s"] > budgets.runtime_s
            or totals["storage_bytes"] > budgets.storage_bytes):
        return None
    return decisions


def _without(first: int, last: int, gaps) -> tuple[tuple[int, int], ...]:
    """The stages first..last (inclusive) less stages a+1..b of each gap (a, b): the runs in which a
    tensor with those gaps dropped is kept."""
    runs, at = [], first
    for a, b in sorted(gaps):
        if a + 1 > at:
            runs.append((at, min(a, last)))
        at = max(at, b + 1)
    if at <= last:
        runs.append((at, last))
    return tuple((x, y) for x, y in runs if x <= y)


SPILL_DEADLINE_CHECK_EVERY = 512


def read_gaps(graph: TrainingGraph, users):
    """Every gap (a, b), two consecutive stages that touch (make or read) tensor i with stages in
    between, of every tensor with bytes: three arrays (tensor, a, b)."""
    import numpy as np

    owner, gap_a, gap_b = [], [], []
    for i, node in enumerate(graph.nodes):
        if node.bytes <= 0:
            continue
        touches = sorted({i, *users[i]})
        for a, b in zip(touches, touches[1:]):
            if b - a >= 2:
                owner.append(i), gap_a.append(a), gap_b.append(b)
    return tuple(np.array(v, dtype=np.int64) for v in (owner, gap_a, gap_b))


def spill_plan(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets,
               deadline: Optional[float] = None) -> Decisions | None:
    """A plan for graphs of any size, in time and memory about linear in the graph: start with every
    tensor out of RAM in every *gap* between two stages that touch it (paged out once, right after
    it is made, and paged back in for the stage after each gap; streamed weights read again from
    storage), so that each stage holds only what its own node reads and writes; then put gaps
    back, those that save the most energy per byte-stage of RAM first, wherever RAM stays within
    the budget. Paging and weight re-reads only, no recomputation of activations: it is the start
    that needs no search, where gap_plan's search over the peak stage takes minutes (it scores
    every gap over the peak at each step) and the MILPs cannot be built. Past ``deadline`` it stops
    putting gaps back: the plan is valid at every point of that loop. None when even the all-out
    plan breaks a budget."""
    import numpy as np

    nodes, T = graph.nodes, len(graph)
    size = np.array([n.bytes for n in nodes], dtype=np.int64)
    users, last = graph.users(), graph.last_use()
    cap = graph.last_compute_stage() if graph.streams_weights else None
    owner, gap_a, gap_b = read_gaps(graph, users)
    # weights come back by a read from storage, and only before their update
    readable = np.array([nodes[i].op != "param" or (not nodes[i].deps and (cap is None or b <= cap[i]))
                         for i, b in zip(owner.tolist(), gap_b.tolist())], dtype=bool)
    owner, gap_a, gap_b = owner[readable], gap_a[readable], gap_b[readable]
    diff = np.zeros(T + 1, dtype=np.int64)
    np.add.at(diff, np.arange(T), size)
    np.add.at(diff, np.asarray(last, dtype=np.int64) + 1, -size)
    np.add.at(diff, gap_a + 1, -size[owner])
    np.add.at(diff, gap_b, size[owner])
    live = np.cumsum(diff)[:T]
    if live.max(initial=0) > budgets.ram_bytes:
        return None
    is_param = np.array([nodes[i].op == "param" for i in owner.tolist()], dtype=bool)
    gaps_of = np.bincount(owner, minlength=T)
    # energy a gap costs when dropped: its page-in (or weights read), and its share of the one page-out
    joules = np.where(is_param, costs.compute_j[owner],
                      costs.page_in_j[owner] + costs.page_out_j[owner] / np.maximum(gaps_of[owner], 1))
    density = joules / (size[owner].astype(float) * (gap_b - gap_a - 1))
    dropped = np.ones(len(owner), dtype=bool)
    ram = budgets.ram_bytes
    for k, g in enumerate(np.argsort(-density, kind="stable").tolist()):
        if k % SPILL_DEADLINE_CHECK_EVERY == 0 and (interrupted() or (deadline is not None
                                                                      and time.perf_counter() > deadline)):
            break
        a, b, s = int(gap_a[g]), int(gap_b[g]), int(size[owner[g]])
        window = live[a + 1:b]
        if window.max() + s <= ram:
            window += s
            dropped[g] = False
    if not _spill_within_storage(owner, gap_a, gap_b, size, is_param, dropped, live, ram, costs, budgets):
        return None
    away: dict[int, list[tuple[int, int]]] = {}
    recompute, page_in, page_out = set(), set(), set()
    for g in np.flatnonzero(dropped).tolist():
        i, a, b = int(owner[g]), int(gap_a[g]), int(gap_b[g])
        away.setdefault(i, []).append((a, b))
        if is_param[g]:
            recompute.add((b, i))
        else:
            page_in.add((b, i))
            page_out.add(i)
    keep = Keep({i: _without(i + 1, last[i], away.get(i, ())) for i in range(T)})
    decisions = Decisions(frozenset(recompute), frozenset(page_in), frozenset(page_out), keep)
    if not fits_storage(costs, budgets, decisions) or plan_runtime_s(costs, decisions) > budgets.runtime_s:
        return None
    if totals_of(graph, costs, build_steps(graph, decisions))["peak_ram_bytes"] > ram:
        return None  # the per-stage sums above disagree with the replay: fail safely
    return decisions


def _spill_within_storage(owner, gap_a, gap_b, size, is_param, dropped, live, ram, costs, budgets) -> bool:
    """Keep whole tensors in RAM again, instead of paging them, until the paged tensors fit the
    storage budget (on raw flash each takes whole erase blocks, 64 KiB for a tensor of a few KiB)
    and the wear budget, those that free the fewest byte-stages of RAM per byte of storage (or of
    wear, whichever is over) first, where RAM allows. Updates ``dropped`` and ``live``; False when
    storage cannot be met this way."""
    import numpy as np

    paged = dropped & ~is_param
    tensors = np.unique(owner[paged]) if paged.any() else np.zeros(0, dtype=np.int64)
    limits = [(per_tensor, limit * (1 + 1e-12)) for per_tensor, limit in storage_limits(costs, budgets)]
    used = [float(per_tensor[tensors].sum()) for per_tensor, _ in limits]
    over = [k for k, (_, limit) in enumerate(limits) if used[k] > limit]
    if not over:
        return True
    region = sum(limits[k][0] for k in over)  # what a tensor kept in RAM gives back, over the rows broken
    by_tensor: dict[int, list[int]] = {}
    for g in np.flatnonzero(paged).tolist():
        by_tensor.setdefault(int(owner[g]), []).append(g)
    relief = {i: sum(int(size[i]) * int(gap_b[g] - gap_a[g] - 1) for g in gs) / max(float(region[i]), 1.0)
              for i, gs in by_tensor.items()}
    for i in sorted(by_tensor, key=lambda i: (relief[i], i)):
        gs = by_tensor[i]
        if all(live[int(gap_a[g]) + 1:int(gap_b[g])].max() + int(size[i]) <= ram for g in gs):
            for g in gs:
                live[int(gap_a[g]) + 1:int(gap_b[g])] += int(size[i])
                dropped[g] = False
            for k, (per_tensor, _) in enumerate(limits):
                used[k] -= float(per_tensor[i])
            if all(used[k] <= limit for k, (_, limit) in enumerate(limits)):
                return True
    return False


def storage_shortfall(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets) -> Optional[str]:
    """Why no start was found when storage is what is missing: the spill plan that fits the RAM
    pages more tensors than storage holds, each in its own whole erase blocks (a row-tiled bert-base
    on an SD card of 4 MiB allocation units). None when storage is not the reason."""
    from dataclasses import replace

    from poet_opt.units import format_bytes

    if not graph.streams_weights or not math.isfinite(budgets.storage_bytes):
        return None
    roomy = spill_plan(graph, costs, replace(budgets, storage_bytes=float("inf"), erase_bytes=float("inf")))
    if roomy is None or fits_storage(costs, budgets, roomy):
        return None
    occupied = paged_region_bytes(costs, roomy)
    if occupied > budgets.storage_bytes:
        return (f"the paging plan that fits {format_bytes(budgets.ram_bytes)} pages {len(roomy.page_out):,} "
                f"tensors: {format_bytes(occupied)} of storage, more than the "
                f"{format_bytes(budgets.storage_bytes)} left beside the weights")
    return (f"the paging plan that fits {format_bytes(budgets.ram_bytes)} pages {len(roomy.page_out):,} tensors, "
            f"wearing {format_bytes(paged_erased_bytes(costs, roomy))} of erase blocks per step, more than the "
            f"{format_bytes(budgets.erase_bytes)} that --min-lifetime-steps leaves beside the weight updates")


def refuse_on_storage(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets) -> None:
    """Raise NoScheduleFound saying so when storage is why no start was found (``storage_shortfall``)."""
    from poet_opt.errors import NoScheduleFound

    short = storage_shortfall(graph, costs, budgets)
    if short:
        raise NoScheduleFound(f"no schedule fits the storage: {short}; use a larger card or more --ram")
