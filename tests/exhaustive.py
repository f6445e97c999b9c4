"""Exhaustive search over the formulation's decision space, written without the formulation.

Stage t computes node t last and may, at each earlier position k, recompute k (forward nodes, and
gradients on graphs small enough for the formulation to allow it)
or page k in (if k was paged out right after its first computation); it then chooses which tensors
to keep for stage t+1. Streamed weights (op "param") are read again like a recompute in every mode,
never paged, and neither they nor a node reading them runs after the node that updates them. Memory follows the replay rules of docs/schedule-format.md: a tensor goes as
soon as nothing later in the stage reads it, unless it is kept. Dynamic programming over
(kept set, paged set) states, with Pareto labels over (energy, runtime) so a runtime budget is exact.
"""

from __future__ import annotations

import itertools
import math


def exhaustive_optimum(graph, costs, ram_bytes, runtime_s=math.inf, mode="joint"):
    """Minimum energy, or None when no schedule in the decision space fits."""
    if ram_bytes >= graph.plain_peak_bytes() and runtime_s >= math.fsum(costs.compute_s) * (1 - 1e-12):
        # Plain training fits, and nothing is cheaper: every node runs at least once and every extra
        # action costs energy >= 0. No search needed (it is the slowest case of the search).
        return math.fsum(costs.compute_j)
    allow_remat = mode in ("joint", "remat")
    allow_paging = mode in ("joint", "paging")
    nodes = graph.nodes
    T = len(nodes)
    size = [n.bytes for n in nodes]
    users = graph.users()
    c_j, c_s = costs.compute_j, costs.compute_s
    pi_j, pi_s, po_j, po_s = costs.page_in_j, costs.page_in_s, costs.page_out_j, costs.page_out_s

    # state: (kept frozenset, paged frozenset) -> list of (energy, runtime) Pareto labels
    is_param = [n.op == "param" for n in nodes]
    # the formulation's stage model: which nodes a stage may compute again (gradients on small graphs)
    from poet_opt.solver.formulation import _recomputable_kind, recomputes_gradients

    gradients = recomputes_gradients(graph, allow_remat)
    again = [_recomputable_kind(n, allow_remat, gradients) for n in nodes]
    after_update = [T] * T  # first stage at which a node would see updated weights
    for u in nodes:
        for p in u.updates:
            for k in (p, *(r for r in range(T) if p in nodes[r].deps and r != u.id)):
                after_update[k] = min(after_update[k], u.id + 1)
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
                if again[k] and t < after_update[k]:
                    choice.append("compute")
                if allow_paging and k in paged:
                    choice.append("page_in")
                options.append(choice)
            out_choices = [False, True] if allow_paging and not is_param[t] else [False]
            for picks in itertools.product(*options):
                # what RAM a stage's plan needs depends on its picks and keeps, not on whether the
                # stage's own output is also paged out: the keeps that fit are found once for both
                made = {k for k, p in enumerate(picks) if p is not None} | {t}
                present_any = set(kept) | made
                # only tensors some later stage could read are worth keeping
                candidates = sorted(i for i in present_any if any(u > t for u in users[i]) or
                                    any(again[u] for u in users[i]))
                # A tensor recomputed or paged in here that nothing computed here reads is
                # only worth it if kept for a later stage: the same plan without it costs no
                # more energy, time or memory, so the optimum never needs it otherwise.
                read_here = {d for k in made if k == t or picks[k] == "compute" for d in nodes[k].deps}
                forced = frozenset(k for k in made if k != t and k not in read_here)
                if not forced <= set(candidates):
                    continue
                free = [i for i in candidates if i not in forced]
                stage = _Stage(t, picks, nodes)
                fitting = [forced | frozenset(rest) for r in range(len(free) + 1)
                           for rest in itertools.combinations(free, r)
                           if stage.fits(kept, forced | frozenset(rest), size, ram_bytes)]
                if not fitting:
                    continue
                e = sum(c_j[k] if p == "compute" else pi_j[k] for k, p in enumerate(picks) if p) + c_j[t]
                s = sum(c_s[k] if p == "compute" else pi_s[k] for k, p in enumerate(picks) if p) + c_s[t]
                for page_out in out_choices:
                    e_out, s_out = (e + po_j[t], s + po_s[t]) if page_out else (e, s)
                    new_paged = paged | {t} if page_out else paged
                    for keep_next in fitting:
                        key = (keep_next, new_paged)
                        for e0, s0 in labels:
                            if s0 + s_out <= runtime_s * (1 + 1e-12):
                                _insert(new_states.setdefault(key, []), (e0 + e_out, s0 + s_out))
        states = new_states
    best = min((e for labels in states.values() for e, _ in labels), default=None)
    return best


class _Stage:
    """Stage t with these picks: what it computes and pages in, and each tensor's last use in it."""

    def __init__(self, t, picks, nodes):
        self.t, self.nodes = t, nodes
        self.computed = [k for k, p in enumerate(picks) if p == "compute"] + [t]
        self.paged_in = [k for k, p in enumerate(picks) if p == "page_in"]
        last_touch = {}
        for k in self.computed:
            last_touch[k] = max(last_touch.get(k, -1), k)
            for d in nodes[k].deps:
                last_touch[d] = max(last_touch.get(d, -1), k)
        for k in self.paged_in:
            last_touch[k] = max(last_touch.get(k, -1), k)
        self.last_touch = last_touch
        self.arrives = set(self.computed) | set(self.paged_in)
        self.computes = set(self.computed)
        self.released_at = {}
        for i, k in last_touch.items():
            self.released_at.setdefault(k, []).append(i)

    def fits(self, kept, keep_next, size, ram_bytes) -> bool:
        """Whether the stage runs within ram_bytes, keeping keep_next for the next, from kept."""
        nodes, last_touch = self.nodes, self.last_touch
        resident = {i for i in kept if i in last_touch or i in keep_next}
        live = sum(size[i] for i in resident)
        for k in range(self.t + 1):
            if k in self.arrives:
                if k in self.computes and any(d not in resident for d in nodes[k].deps):
                    return False
                resident.add(k)
                live += size[k]
                if live > ram_bytes:
                    return False
            for i in self.released_at.get(k, ()):
                if i in resident and i not in keep_next:
                    resident.discard(i)
                    live -= size[i]
        return keep_next <= resident


def _insert(labels, label):
    e, s = label
    for e0, s0 in labels:
        if e0 <= e + 1e-15 and s0 <= s + 1e-15:
            return
    labels[:] = [(e0, s0) for e0, s0 in labels if not (e <= e0 and s <= s0)]
    labels.append(label)
