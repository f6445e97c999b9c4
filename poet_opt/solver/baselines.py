"""Classic heuristic baselines, each replayed into our Decisions and judged by our cost model and
validator, so the benchmark compares like with like.

- ``checkpoint-all``: plain training (every activation kept until its last reader); it fits only
  when the budget is at least the plain peak.
- ``sqrt-n``: Chen et al. (2016), "Training deep nets with sublinear memory cost": cut the forward
  pass into about sqrt(n) segments, keep only the segment boundaries, and recompute a segment's
  activations when the backward pass first needs them. On graphs with branches a boundary must be
  a node every later forward node depends on only through it; we take the *bottlenecks* of the
  topological order (no forward edge jumps over the node), which for a single-input network are
  the articulation points Chen et al. cut at (block outputs of a ResNet or a transformer), and
  place a boundary at the first bottleneck after every ceil(sqrt(n)) forward nodes (or, on graphs
  with long skips and hardly any bottleneck, after 2 ceil(sqrt(n)) nodes: a segment's recomputation
  then also rebuilds what its skips need from earlier segments, recursively). It ignores the
  budget, as the method does: it either fits or it does not.
- ``dtr``: a greedy online eviction after Dynamic Tensor Rematerialization (Kirisame et al., 2021),
  replayed offline: run the nodes in order, free each tensor after its last reader, and when the
  next tensor would not fit, evict the resident forward tensor with the smallest
  h = compute time / (bytes x staleness) (the paper's basic heuristic, without its equivalence-class
  refinement); a missing input is recomputed on demand, recursively. Tensors read later in the
  current stage are locked, as DTR locks the operands of the running operator, and gradients are
  never evicted (remat only: nothing could recompute them). Fails when the locked tensors alone
  overflow the budget.

Node-link graphs may feed a gradient into a forward node (a ``backward`` node read by a forward
one). Gradients are never recomputed, so neither is a forward node that reads one, directly or
through other forward nodes (``needs_gradient``): DTR never evicts it and sqrt(n) keeps it as a
checkpoint, so both baselines still apply, with those tensors held like gradients.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, replace
from typing import Optional

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Budgets, Decisions, Keep, build_steps, plain_decisions, totals_of
from poet_opt.solver.checkpointing import recompute_on_demand

BASELINES = ("checkpoint-all", "sqrt-n", "dtr")


@dataclass
class BaselineResult:
    name: str
    decisions: Optional[Decisions]  # None: the method found no plan (dtr under a too-small budget)
    totals: Optional[dict]  # our cost model on the replayed steps, checked by the validator
    fits: bool  # within the RAM and runtime budgets (storage is untouched: remat only)
    note: str = ""


def bottlenecks(graph: TrainingGraph) -> list[int]:
    """Forward nodes (loss included) that no forward edge jumps over in the topological order."""
    forward = [n.id for n in graph.nodes if not n.is_backward]
    is_forward = [not n.is_backward for n in graph.nodes]
    reach = -1  # furthest forward node read from anything strictly before the current one
    out = []
    users = graph.users()
    for v in forward:
        if reach <= v:
            out.append(v)
        reach = max([reach, *(u for u in users[v] if is_forward[u])])
    return out


def needs_gradient(graph: TrainingGraph) -> set[int]:
    """Forward nodes that read a gradient, directly or through other forward nodes: recomputing one
    would need that gradient again, and gradients are never recomputed."""
    out: set[int] = set()
    for node in graph.nodes:  # topological order: every dep is decided before its reader
        if not node.is_backward and any(graph.nodes[d].is_backward or d in out for d in node.deps):
            out.add(node.id)
    return out


def sqrt_n_checkpoints(graph: TrainingGraph) -> set[int]:
    """Segment boundaries: the input(s), the loss, and the first bottleneck after every
    ceil(sqrt(n)) forward nodes, or the node 2 ceil(sqrt(n)) after the last boundary if no
    bottleneck comes by then (random graphs with long skips have almost none); and every forward
    node that cannot be recomputed because it reads a gradient."""
    forward = [n.id for n in graph.nodes if not n.is_backward]
    seg = max(1, math.ceil(math.sqrt(len(forward))))
    cuts = set(bottlenecks(graph))
    kept = {n.id for n in graph.nodes if not n.is_backward and (n.op == "input" or n.kind == "loss")}
    kept |= needs_gradient(graph)
    since = 0
    for v in forward:
        since += 1
        if (since >= seg and v in cuts) or since >= 2 * seg:
            kept.add(v)
            since = 0
    return kept


def segment_decisions(graph: TrainingGraph, checkpoints: set[int], deadline: Optional[float] = None) -> Decisions:
    """Keep the checkpoints (and every gradient); free every other forward tensor once the forward
    pass is done with it, and recompute it, with whatever it needs that is gone too, in the first
    later stage that reads it, keeping it until its last reader. A checkpoint stays in RAM until
    the last stage that reads it, recomputations included: the first pass holds checkpoints to the
    end to find those stages, the second releases them there (the recomputations are the same,
    since they depend only on what the checkpoints cover)."""
    T, last = len(graph), graph.last_use()
    dropped = {n.id for n in graph.nodes if not n.is_backward and n.id not in checkpoints}
    _, _, read_at = recompute_on_demand(graph, dropped, lambda i: T - 1 if i in checkpoints else last[i],
                                        deadline=deadline)
    recompute, keep, _ = recompute_on_demand(
        graph, dropped, lambda i: max(last[i], read_at.get(i, i)) if i in checkpoints else last[i],
        deadline=deadline)
    return Decisions(frozenset(recompute), frozenset(), frozenset(), keep)


def sqrt_n_decisions(graph: TrainingGraph, deadline: Optional[float] = None) -> Decisions:
    """Raises DeadlinePassed once ``time.perf_counter()`` passes ``deadline``."""
    return segment_decisions(graph, sqrt_n_checkpoints(graph), deadline=deadline)


def dtr_decisions(graph: TrainingGraph, costs: NodeCosts, ram_bytes: float,
                  deadline: Optional[float] = None) -> Optional[Decisions]:
    """None when DTR runs out of memory, or when ``time.perf_counter()`` passes ``deadline`` (each
    stage scans what is resident: quadratic in the graph)."""
    nodes, T = graph.nodes, len(graph)
    size = [n.bytes for n in nodes]
    last = graph.last_use()
    # held like gradients: evicting one would need a gradient, which nothing recomputes, again
    pinned = [n.is_backward for n in nodes]
    for i in needs_gradient(graph):
        pinned[i] = True
    resident: set[int] = set()
    last_access = [0] * T
    clock = 0
    recompute, keep = set(), set()
    for t in range(T):
        if deadline is not None and t % 64 == 0 and time.perf_counter() > deadline:
            return None
        needed, stack = set(), [d for d in nodes[t].deps if d not in resident]
        while stack:
            i = stack.pop()
            if i in needed:
                continue
            if pinned[i]:  # never evicted, so never missing: a bug if it happens
                raise RuntimeError(f"dtr lost gradient {i}")
            needed.add(i)
            stack.extend(d for d in nodes[i].deps if d not in resident and d not in needed)
        computed = sorted(needed) + [t]
        last_touch: dict[int, int] = {}
        for k in computed:
            last_touch[k] = max(last_touch.get(k, -1), k)
            for d in nodes[k].deps:
                last_touch[d] = max(last_touch.get(d, -1), k)
        # what nothing reads any more goes at the stage start (as our step builder frees it)
        resident = {i for i in resident if i in last_touch or last[i] > t}
        live = sum(size[i] for i in resident)
        for k in computed:
            while live + size[k] > ram_bytes:
                victims = [i for i in resident if not pinned[i] and last_touch.get(i, -1) < k]
                if not victims:
                    return None

                def h(i):
                    staleness = clock - last_access[i] + 1
                    return costs.compute_s[i] / (max(size[i], 1) * staleness)

                victim = min(victims, key=lambda i: (h(i), -size[i], i))
                resident.discard(victim)
                live -= size[victim]
            clock += 1
            for d in nodes[k].deps:
                last_access[d] = clock
            last_access[k] = clock
            resident.add(k)
            live += size[k]
            if k != t:
                recompute.add((t, k))
            for i in [i for i in resident if last_touch.get(i) == k and last[i] <= t]:
                resident.discard(i)
                live -= size[i]
        keep.update((t + 1, i) for i in resident if t + 1 < T)
    return Decisions(frozenset(recompute), frozenset(), frozenset(), frozenset(keep))


def without_idle_keeps(graph: TrainingGraph, decisions: Decisions) -> Decisions:
    """Drop each keep (t, i) after which i is neither read in stage t nor kept further. Our step
    builder frees such a tensor at the stage start anyway, so the plan and its replay are
    unchanged; but a MILP counts a kept tensor for the whole stage, and would reject the plan as a
    MIP start (DTR evicts tensors it kept into a stage before that stage reads them)."""
    nodes = graph.nodes
    reads_of: dict[int, set[int]] = {}  # tensor -> stages that read it
    for t in range(len(graph)):
        for d in nodes[t].deps:
            reads_of.setdefault(d, set()).add(t)
    for t, k in decisions.recompute:
        for d in nodes[k].deps:
            reads_of.setdefault(d, set()).add(t)
    # Runs are never adjacent, so the keep after a run's last stage is absent and each run loses
    # its tail back to the last stage in it that reads the tensor (all of it when none does).
    trimmed = {}
    for i, runs in decisions.keep.runs.items():
        stages = sorted(reads_of.get(i, ()))
        kept = []
        for a, b in runs:
            k = bisect.bisect_right(stages, b) - 1
            if k >= 0 and stages[k] >= a:
                kept.append((a, stages[k]))
        trimmed[i] = tuple(kept)
    return Decisions(decisions.recompute, decisions.page_in, decisions.page_out, Keep(trimmed))


def evaluate(graph: TrainingGraph, profile, costs: NodeCosts, budgets: Budgets, name: str,
             decisions: Optional[Decisions], note: str = "") -> BaselineResult:
    """Our step builder, cost model and validator on a baseline's decisions. The rules are checked
    with the RAM and runtime budgets relaxed to the plan's own figures, so a plan over budget is
    still measured; `fits` says whether it meets the real ones."""
    from poet_opt.solver.dense import validated_totals  # shared helper; dense imports nothing from here

    if decisions is None:
        return BaselineResult(name, None, None, False, note or "no plan within the RAM budget")
    steps = build_steps(graph, decisions)
    totals = totals_of(graph, costs, steps)
    relaxed = replace(budgets, ram_bytes=max(budgets.ram_bytes, totals["peak_ram_bytes"]), runtime_s=math.inf)
    totals = validated_totals(graph, profile, costs, relaxed, steps)
    fits = (totals["peak_ram_bytes"] <= budgets.ram_bytes
            and totals["runtime_s"] <= budgets.runtime_s * (1 + 1e-9))
    return BaselineResult(name, decisions, totals, fits, note)


def run_baselines(graph: TrainingGraph, profile, costs: NodeCosts, budgets: Budgets) -> dict[str, BaselineResult]:
    return {
        "checkpoint-all": evaluate(graph, profile, costs, budgets, "checkpoint-all", plain_decisions(graph)),
        "sqrt-n": evaluate(graph, profile, costs, budgets, "sqrt-n", without_idle_keeps(graph, sqrt_n_decisions(graph))),
        "dtr": evaluate(graph, profile, costs, budgets, "dtr", _pruned(graph, dtr_decisions(graph, costs, budgets.ram_bytes))),
    }


def _pruned(graph, decisions):
    return None if decisions is None else without_idle_keeps(graph, decisions)
