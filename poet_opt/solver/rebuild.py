"""Rebuild instead of page: an improvement step on a paging plan that recomputes activations.

The spill plan (heuristics.spill_plan) brings every activation back by a page-in, and pages it out
once for that. On a stripped graph many are cheap to rebuild: a ReLU strip is one ReLU over one
batch-norm output, a normalization of the convolution's output strip (often paged too) by
statistics of a few hundred bytes; a concatenation strip is a copy of the convolution slices' outputs.
Rebuilding the ReLU strip where it is read, from a page-in of the convolution's strip, reads as many
bytes as paging the ReLU strip in; but if every return of it is rebuilt, it is never paged out, and
its write is saved. And where the convolution's strip is paged in a few stages later anyway, that
page-in can come earlier and the strip stay in RAM until then: the rebuild then costs only its
arithmetic, and saves the whole page-in even where the ReLU strip is still paged for other readers.

The step, per tensor paged out: replace each of its page-ins by a *chain* in that same stage, a
recomputation of the tensor whose inputs are in RAM there already, or paged in there (only tensors
the plan pages out anyway), or whose next page-in is moved there and the tensor kept until it (a
*hold*, of at most MAX_HOLD stages), or read again (weights, before their update), or themselves
rebuilt the same way, a few levels deep. A tensor whose every page-in has a chain, cheaper in all
than its page-ins and its page-out, stops being paged out; then, page-in by page-in, each chain
cheaper than the page-in it replaces is taken. Every move must keep each stage it touches within the
RAM budget; the tensors that save most go first, in rounds until none saves any.

Why this is safe to check locally: a chain adds work only to the stage it replaces a page-in in, and
a hold adds its tensor's bytes, untouched, to the stages it spans and moves one page-in: each stage's
peak is replayed here by the same rules as build_steps (docs/schedule-format.md), a spanned stage's
as its own peak plus the bytes held across it, and no other stage sees any difference. The whole plan
is replayed once at the end and the input plan returned if anything disagrees, so a mismatch fails
safely; the driver's validator checks the result like any plan.
"""

from __future__ import annotations

import math
import time
from typing import Optional

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, Decisions, Keep, build_steps, totals_of
from poet_opt.solver.backends import interrupted

# How many levels of recomputation a chain may have below the tensor it rebuilds: ReLU over batch
# norm over a concatenation of convolution slices is three; deeper chains reach convolutions, which
# cost more than the page-in they would replace.
MAX_DEPTH = 3
# The most stages a page-in may move earlier (the tensor held in RAM across them): each spanned
# stage is checked per chain, and long holds rarely fit a budget the spill plan has already filled.
MAX_HOLD = 48
# Gains below this many joules are rounding in the costs, not worth a stage replay.
MIN_GAIN_J = 1e-12
# The step indexes every (stage, tensor) a keep spans, so its memory and time grow with the keep
# runs' total length: 0.6 million on ResNet-18's strips and 0.4 million on bert-base's rows, but
# billions on a 100,000-node graph whose spill plan keeps tensors across tens of thousands of stages,
# where it took 20 GiB and minutes past a 30 s limit. Past this the spill plan stands as it is.
MAX_KEEP_VOLUME = 5_000_000


class _Plan:
    """A paging plan as per-stage sets, with each stage's peak RAM replayed on demand."""

    def __init__(self, graph: TrainingGraph, decisions: Decisions):
        self.graph = graph
        T = len(graph)
        self.size = [n.bytes for n in graph.nodes]
        self.deps = [tuple(n.deps) for n in graph.nodes]
        self.recompute: dict[int, set[int]] = {}
        self.page_in: dict[int, set[int]] = {}
        self.page_ins_of: dict[int, set[int]] = {}
        self.recomputes_of: dict[int, set[int]] = {}
        for t, i in decisions.recompute:
            self.recompute.setdefault(t, set()).add(i)
            self.recomputes_of.setdefault(i, set()).add(t)
        for t, i in decisions.page_in:
            self.page_in.setdefault(t, set()).add(i)
            self.page_ins_of.setdefault(i, set()).add(t)
        self.page_out = set(decisions.page_out)
        self.runs = {i: list(rs) for i, rs in decisions.keep.runs.items()}
        self.keep = decisions.keep
        # per stage, the tensors with bytes kept into it: what RAM holds is bounded by the budget,
        # while a tensor of no bytes may be kept from the forward pass to the backward (asked of keep)
        self.kept_in: list[set[int]] = [set() for _ in range(T + 1)]
        for i, rs in self.runs.items():
            if not self.size[i]:
                continue
            for a, b in rs:
                for t in range(a, b + 1):
                    self.kept_in[t].add(i)
        self._peak: dict[int, int] = {}

    def resident(self, t: int, x: int) -> bool:
        """Whether tensor x is in RAM for a recomputation in stage t before position t."""
        return (x in self.kept_in[t] if self.size[x] else (t, x) in self.keep) or x in self.page_in.get(t, ()) \
            or x in self.recompute.get(t, ())

    def peak(self, t: int) -> int:
        if t not in self._peak:
            self._peak[t] = self.stage_peak(t, self.recompute.get(t, set()), self.page_in.get(t, set()),
                                            self.kept_in[t], self.kept_in[t + 1])
        return self._peak[t]

    def stage_peak(self, t: int, recompute, page_in, kept_in, kept_out) -> int:
        """Stage t's peak RAM with these actions and keeps, replayed as build_steps does."""
        size, deps = self.size, self.deps
        computed = sorted(recompute) + [t]
        last_touch: dict[int, int] = {}
        for k in computed:
            last_touch[k] = max(last_touch.get(k, -1), k)
            for d in deps[k]:
                last_touch[d] = max(last_touch.get(d, -1), k)
        for i in page_in:
            last_touch[i] = max(last_touch.get(i, -1), i)
        resident = {i for i in kept_in if i in last_touch or i in kept_out}
        live = peak = sum(size[i] for i in resident)
        releases: dict[int, list[int]] = {}
        for i, pos in last_touch.items():
            if i not in kept_out:
                releases.setdefault(pos, []).append(i)
        computed_set = set(computed)
        for k in sorted(computed_set | set(page_in)):
            if k in page_in:
                resident.add(k)
                live += size[k]
                peak = max(peak, live)
            if k in computed_set:
                resident.add(k)
                live += size[k]
                peak = max(peak, live)
            for i in releases.get(k, ()):
                if i in resident:
                    resident.discard(i)
                    live -= size[i]
        return peak

    def next_page_in(self, x: int, t: int) -> Optional[int]:
        """The stage of x's first page-in after stage t, if a hold from t could serve it: within
        MAX_HOLD stages, with x neither recomputed nor kept in between."""
        later = [s for s in self.page_ins_of.get(x, ()) if t < s <= t + MAX_HOLD]
        if not later:
            return None
        b = min(later)
        if any(t < s < b for s in self.recomputes_of.get(x, ())) or any(x in self.kept_in[s] for s in range(t + 1, b + 1)):
            return None
        return b


class _Move:
    """What one move changes, stage by stage: recomputations and page-ins added, page-ins taken away,
    tensors held (kept into the stages after their new page-in, up to the one it served)."""

    def __init__(self):
        self.recompute: dict[int, set[int]] = {}
        self.page_in: dict[int, set[int]] = {}
        self.unpage: dict[int, set[int]] = {}
        self.holds: list[tuple[int, int, int]] = []  # (tensor, new page-in stage, old page-in stage)

    def held(self, t: int, x: int) -> bool:
        """Whether this move already holds x into stage t."""
        return any(h == x and a < t <= b for h, a, b in self.holds)

    def add(self, t: int, actions: dict) -> None:
        for x, how in actions.items():
            if how == "rc":
                self.recompute.setdefault(t, set()).add(x)
            elif how == "in":
                self.page_in.setdefault(t, set()).add(x)
            else:  # ("hold", b): x's page-in at b comes to t
                self.page_in.setdefault(t, set()).add(x)
                self.unpage.setdefault(how[1], set()).add(x)
                self.holds.append((x, t, how[1]))

    def fits(self, plan: _Plan, ram: float) -> bool:
        held_into: dict[int, set[int]] = {}
        for x, a, b in self.holds:
            for s in range(a + 1, b + 1):
                held_into.setdefault(s, set()).add(x)
        touched = set(self.recompute) | set(self.page_in) | set(self.unpage)
        for s in touched | {s - 1 for s in held_into}:
            kin, kout = held_into.get(s, set()), held_into.get(s + 1, set())
            if s not in touched and kin == kout:  # spanned, untouched: its own peak plus what is held
                if plan.peak(s) + sum(plan.size[x] for x in kin) > ram:
                    return False
                continue
            peak = plan.stage_peak(s, plan.recompute.get(s, set()) | self.recompute.get(s, set()),
                                   (plan.page_in.get(s, set()) | self.page_in.get(s, set())) - self.unpage.get(s, set()),
                                   plan.kept_in[s] | kin, plan.kept_in[s + 1] | kout)
            if peak > ram:
                return False
        return True

    def apply(self, plan: _Plan) -> None:
        for t, xs in self.recompute.items():
            plan.recompute.setdefault(t, set()).update(xs)
            for x in xs:
                plan.recomputes_of.setdefault(x, set()).add(t)
            plan._peak.pop(t, None)
        for t, xs in self.unpage.items():
            plan.page_in[t] -= xs
            for x in xs:
                plan.page_ins_of[x].discard(t)
            plan._peak.pop(t, None)
        for t, xs in self.page_in.items():
            plan.page_in.setdefault(t, set()).update(xs)
            for x in xs:
                plan.page_ins_of.setdefault(x, set()).add(t)
            plan._peak.pop(t, None)
        for x, a, b in self.holds:
            for s in range(a + 1, b + 1):
                plan.kept_in[s].add(x)
                plan._peak.pop(s, None)
            plan.runs[x] = _merged(plan.runs.get(x, []) + [(a + 1, b)])
            plan._peak.pop(a, None)


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _chain(plan: _Plan, costs: NodeCosts, cap, t: int, x: int, depth: int, avoid: int, actions: dict,
           holds: bool, pending: _Move, limit: float) -> Optional[float]:
    """The cheapest way found to have tensor x in RAM in stage t before position t, as actions added
    to ``actions`` (x -> "in" for a page-in, "rc" for a recomputation or a weight read, ("hold", b)
    for its page-in at b moved to t), and its cost in joules; None when there is none within
    ``depth`` levels. ``avoid``: the tensor being rebuilt, which is not brought back otherwise;
    ``pending``: the move so far, whose holds are in RAM where they span; ``limit``: no recomputation
    dearer than this is tried (the chain would cost more than what it replaces)."""
    if x in actions or (x != avoid and (plan.resident(t, x) or pending.held(t, x))):
        return 0.0
    node = plan.graph.nodes[x]
    options: list[tuple[float, dict]] = []
    if x != avoid and x in plan.page_out:
        b = plan.next_page_in(x, t) if holds and plan.size[x] else None
        options.append((0.0, {x: ("hold", b)}) if b is not None else (float(costs.page_in_j[x]), {x: "in"}))
    if node.op == "param":
        if not node.deps and (cap is None or t <= cap[x]):
            options.append((float(costs.compute_j[x]), {x: "rc"}))
    elif node.kind == "forward" and node.op != "input" and depth > 0 and (cap is None or t <= cap[x]) \
            and costs.compute_j[x] < limit:
        sub = dict(actions)
        total = float(costs.compute_j[x])
        for d in node.deps:
            c = _chain(plan, costs, cap, t, d, depth - 1, avoid, sub, holds, pending, limit)
            if c is None:
                total = None
                break
            total += c
        if total is not None:
            sub[x] = "rc"
            options.append((total, {k: v for k, v in sub.items() if k not in actions}))
    if not options:
        return None
    cost, chosen = min(options, key=lambda o: o[0])
    actions.update(chosen)
    return cost


def _whole(plan: _Plan, costs: NodeCosts, cap, i: int, holds: bool) -> Optional[tuple[float, _Move]]:
    """Tensor i rebuilt at every one of its page-ins and no longer paged out: the energy saved and
    the move; None when some page-in has no chain."""
    joules = float(costs.page_out_j[i])
    move = _Move()
    for t in sorted(plan.page_ins_of.get(i, ())):
        actions: dict = {}
        cost = _chain(plan, costs, cap, t, i, MAX_DEPTH, i, actions, holds, move,
                      float(costs.page_in_j[i] + costs.page_out_j[i]))
        if cost is None or actions.get(i) != "rc":
            return None
        joules += float(costs.page_in_j[i]) - cost
        move.add(t, actions)
        move.unpage.setdefault(t, set()).add(i)
    return joules, move


def _single(plan: _Plan, costs: NodeCosts, cap, i: int, t: int, holds: bool) -> Optional[tuple[float, _Move]]:
    """Tensor i's page-in at stage t alone replaced by a chain (it stays paged for the others)."""
    actions: dict = {}
    move = _Move()
    cost = _chain(plan, costs, cap, t, i, MAX_DEPTH, i, actions, holds, move, float(costs.page_in_j[i]))
    if cost is None or actions.get(i) != "rc":
        return None
    move.add(t, actions)
    move.unpage.setdefault(t, set()).add(i)
    return float(costs.page_in_j[i]) - cost, move


def rebuild_paged(graph: TrainingGraph, costs: NodeCosts, budgets: Budgets, decisions: Decisions,
                  deadline: Optional[float] = None) -> tuple[Decisions, float]:
    """``decisions`` with paged tensors rebuilt where they are read instead (module docstring), and
    the energy saved in joules (0.0 and the plan itself when nothing is)."""
    if not decisions.page_out or not decisions.page_in:
        return decisions, 0.0

    def late() -> bool:
        return interrupted() or (deadline is not None and time.perf_counter() > deadline)

    if sum(b - a + 1 for runs in decisions.keep.runs.values() for a, b in runs) > MAX_KEEP_VOLUME:
        return decisions, 0.0
    plan = _Plan(graph, decisions)
    if late():
        return decisions, 0.0
    cap = graph.last_compute_stage() if graph.streams_weights else None
    nodes = graph.nodes
    ram = budgets.ram_bytes

    def rebuildable(i: int) -> bool:
        return nodes[i].kind == "forward" and nodes[i].op not in ("param", "input")

    def take(found) -> float:
        """Apply the first of (saved, move) candidates with holds, then without, that fits."""
        for candidate in found:
            if candidate is not None and candidate[0] > MIN_GAIN_J and candidate[1].fits(plan, ram):
                candidate[1].apply(plan)
                return candidate[0]
        return 0.0

    saved = 0.0
    for _ in range(8):  # rounds: a move can open another (a leaf held, a page-out gone)
        before = saved
        scored = sorted(((g[0], i) for i in plan.page_out if rebuildable(i)
                         for g in [_whole(plan, costs, cap, i, True)] if g is not None and g[0] > MIN_GAIN_J),
                        reverse=True)
        for k, (_, i) in enumerate(scored):
            if k % 64 == 0 and late():
                break
            gained = take((_whole(plan, costs, cap, i, True), _whole(plan, costs, cap, i, False)))
            if gained:
                plan.page_out.discard(i)
                plan.page_ins_of.pop(i, None)
                saved += gained
        singles = sorted(((costs.page_in_j[i], t, i) for t, xs in plan.page_in.items() for i in xs
                          if i in plan.page_out and rebuildable(i)), reverse=True)
        for k, (_, t, i) in enumerate(singles):
            if k % 64 == 0 and late():
                break
            if i in plan.page_in.get(t, ()):
                saved += take((_single(plan, costs, cap, i, t, True), _single(plan, costs, cap, i, t, False)))
        if saved - before <= MIN_GAIN_J or late():
            break
    if saved <= MIN_GAIN_J:
        return decisions, 0.0
    # a tensor whose page-ins are all rebuilt now is only a write
    read_back = {x for _, x in decisions.page_in}
    plan.page_out = {i for i in plan.page_out if plan.page_ins_of.get(i) or i not in read_back}
    better = Decisions(frozenset((t, x) for t, xs in plan.recompute.items() for x in xs),
                       frozenset((t, x) for t, xs in plan.page_in.items() for x in xs),
                       frozenset(plan.page_out), Keep({i: rs for i, rs in plan.runs.items() if rs}))
    try:
        totals = totals_of(graph, costs, build_steps(graph, better))
    except RuntimeError:
        return decisions, 0.0
    given = _energy_j(costs, decisions)
    if totals["peak_ram_bytes"] > ram or totals["runtime_s"] > budgets.runtime_s or totals["energy_j"] >= given:
        return decisions, 0.0  # the local replays disagree with the whole one: fail safely
    return better, given - totals["energy_j"]


def _energy_j(costs: NodeCosts, decisions: Decisions) -> float:
    """The plan's energy as totals_of counts it, without a replay: heuristics.plan_energy_j, which
    this module cannot import (heuristics runs this step on its spill plan)."""
    return math.fsum([*map(float, costs.compute_j), *(float(costs.compute_j[i]) for _, i in decisions.recompute),
                      *(float(costs.page_in_j[i]) for _, i in decisions.page_in),
                      *(float(costs.page_out_j[i]) for i in decisions.page_out)])
