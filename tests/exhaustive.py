"""Exhaustive search over the formulation's decision space, written without the formulation.

Stage t computes node t last and may, at each earlier position k, recompute k (forward nodes only)
or page k in (if k was paged out right after its first computation); it then chooses which tensors
to keep for stage t+1. Memory follows the replay rules of docs/schedule-format.md: a tensor goes as
soon as nothing later in the stage reads it, unless it is kept. Dynamic programming over
(kept set, paged set) states, with Pareto labels over (energy, runtime) so a runtime budget is exact.
"""

from __future__ import annotations

import itertools
import math


def exhaustive_optimum(graph, costs, ram_bytes, runtime_s=math.inf, mode="joint"):
    """Minimum energy, or None when no schedule in the decision space fits."""
    allow_remat = mode in ("joint", "remat")
    allow_paging = mode in ("joint", "paging")
    nodes = graph.nodes
    T = len(nodes)
    size = [n.bytes for n in nodes]
    users = graph.users()
    c_j, c_s = costs.compute_j, costs.compute_s
    pi_j, pi_s, po_j, po_s = costs.page_in_j, costs.page_in_s, costs.page_out_j, costs.page_out_s

    # state: (kept frozenset, paged frozenset) -> list of (energy, runtime) Pareto labels
    states = {(frozenset(), frozenset()): [(0.0, 0.0)]}
    for t in range(T):
        new_states: dict = {}
        for (kept, paged), labels in states.items():
            options = []
            for k in range(t):
                choice = [None]
                if k in kept:
                    options.append(choice)
                    continue
                if allow_remat and not nodes[k].is_backward:
                    choice.append("compute")
                if allow_paging and k in paged:
                    choice.append("page_in")
                options.append(choice)
            out_choices = [False, True] if allow_paging else [False]
            for picks in itertools.product(*options):
                for page_out in out_choices:
                    made = {k for k, p in enumerate(picks) if p is not None} | {t}
                    present_any = set(kept) | made
                    # only tensors some later stage could read are worth keeping
                    candidates = sorted(i for i in present_any if any(u > t for u in users[i]) or
                                        (allow_remat and any(not nodes[u].is_backward for u in users[i])))
                    for r in range(len(candidates) + 1):
                        for keep_next in itertools.combinations(candidates, r):
                            keep_next = frozenset(keep_next)
                            result = _run_stage(t, kept, picks, keep_next, nodes, size, ram_bytes)
                            if result is None:
                                continue
                            e = sum(c_j[k] if p == "compute" else pi_j[k] for k, p in enumerate(picks) if p) + c_j[t]
                            s = sum(c_s[k] if p == "compute" else pi_s[k] for k, p in enumerate(picks) if p) + c_s[t]
                            if page_out:
                                e, s = e + po_j[t], s + po_s[t]
                            new_paged = paged | {t} if page_out else paged
                            key = (keep_next, new_paged)
                            for e0, s0 in labels:
                                if s0 + s <= runtime_s * (1 + 1e-12):
                                    _insert(new_states.setdefault(key, []), (e0 + e, s0 + s))
        states = new_states
    best = min((e for labels in states.values() for e, _ in labels), default=None)
    return best


def _run_stage(t, kept, picks, keep_next, nodes, size, ram_bytes):
    computed = [k for k, p in enumerate(picks) if p == "compute"] + [t]
    paged_in = [k for k, p in enumerate(picks) if p == "page_in"]
    last_touch = {}
    for k in computed:
        last_touch[k] = max(last_touch.get(k, -1), k)
        for d in nodes[k].deps:
            last_touch[d] = max(last_touch.get(d, -1), k)
    for k in paged_in:
        last_touch[k] = max(last_touch.get(k, -1), k)
    resident = {i for i in kept if i in last_touch or i in keep_next}
    live = sum(size[i] for i in resident)
    for k in range(t + 1):
        if k in paged_in or k in computed:
            if k in computed and any(d not in resident for d in nodes[k].deps):
                return None
            resident.add(k)
            live += size[k]
            if live > ram_bytes:
                return None
        for i in [i for i in resident if last_touch.get(i, -1) == k and i not in keep_next]:
            resident.discard(i)
            live -= size[i]
    if not keep_next <= resident:
        return None
    return True


def _insert(labels, label):
    e, s = label
    for e0, s0 in labels:
        if e0 <= e + 1e-15 and s0 <= s + 1e-15:
            return
    labels[:] = [(e0, s0) for e0, s0 in labels if not (e <= e0 and s <= s0)]
    labels.append(label)
