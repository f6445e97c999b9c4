"""Segment-wise checkpointing: drop some forward tensors after the forward pass and recompute them,
with whatever they need that is gone too, when a later stage reads them. The replay that both the
greedy heuristics and the sqrt(n) and DTR baselines build their plans on."""

from __future__ import annotations

import time
from typing import Optional

from poet_opt.errors import DeadlinePassed
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import Decisions, Keep


def checkpoint_decisions(graph: TrainingGraph, dropped: set[int]) -> Decisions:
    """Plain training, except that each forward tensor in `dropped` is freed once the forward pass
    no longer reads it, recomputed (with whatever it needs that is gone too) in the first later
    stage that reads it, and then kept until its last reader: segment-wise checkpointing."""
    recompute, keep, _ = recompute_on_demand(graph, dropped)
    return Decisions(frozenset(recompute), frozenset(), frozenset(), keep)


def recompute_on_demand(graph: TrainingGraph, dropped: set[int], kept_until=None, deadline: Optional[float] = None):
    """The replay behind checkpointing: each forward tensor in `dropped` is freed once the forward
    pass no longer reads it and recomputed, with whatever it needs that is gone too, in the first
    later stage that reads it; every other tensor stays resident until stage ``kept_until(i)``
    (default: its last reader). Returns the (stage, node) recomputations, the keeps (a Keep), and
    per tensor the last stage that reads it, recomputations included. Raises DeadlinePassed once
    ``time.perf_counter()`` passes ``deadline``."""
    nodes, users = graph.nodes, graph.users()
    last = graph.last_use()
    resident_until = {}  # i -> last stage in which i is resident (from its latest materialization)
    keep_ranges, recompute = [], set()
    read_at: dict[int, int] = {}

    def hold(i, start):
        if i in dropped:
            forward_readers = [u for u in users[i] if not nodes[u].is_backward and u > start]
            end = max([start, *forward_readers]) if start == i else max(start, last[i])
        else:
            end = last[i] if kept_until is None else kept_until(i)
        keep_ranges.append((i, start + 1, end))
        resident_until[i] = end

    for t in range(len(graph)):
        if deadline is not None and t % 512 == 0 and time.perf_counter() > deadline:
            raise DeadlinePassed
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
        for k in needed | {t}:
            for d in nodes[k].deps:
                read_at[d] = max(read_at.get(d, -1), t)
    return recompute, Keep.from_ranges(keep_ranges), read_at
