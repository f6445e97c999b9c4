"""The true optimum over every step sequence the replay rules allow, written from the rules alone.

docs/schedule-format.md's rules, and nothing else: from an empty RAM and storage,

- ``compute n``: every dep of n resident, n not resident; then n is resident;
- ``page_out n``: n resident; then a copy is on storage (the RAM copy stays);
- ``page_in n``: n on storage and not resident; then n is resident;
- ``free n``: n resident; then it is not;

RAM (bytes of the resident nodes) is measured after every compute and page_in and must stay within
``ram_bytes``; the runtime (sum of the step times) within ``runtime_s``; the bytes of the nodes ever
paged out within ``storage_bytes``; every node is computed at least once. Energy is compute +
page-in + page-out. Modes: ``joint`` (everything), ``remat`` (no paging), ``paging`` (each node
computed exactly once), ``none`` (neither).

Nothing here knows of stages, numberings or the formulation: any node, forward or backward, may be
computed again whenever its deps are resident, in any order, as often as it pays.

The search is A* (uniform-cost search with an admissible, consistent heuristic) over states
``(C, R, S)``: C the nodes computed at least once, R the resident nodes, S the stored nodes, each an
int bitmask. The heuristic is the compute energy of the nodes not yet in C: each of them must still
be computed once, a first computation lowers it by exactly its own cost and no other step changes it,
so it is consistent and the first goal popped is optimal. With a finite runtime (or storage) budget
every state carries Pareto labels (energy, runtime, storage); a label is dropped only when another
label of the same state is no worse in all three.

Reductions. Each is a statement "some optimal sequence has this form", proved below from the rules;
the search then only generates sequences of that form. Start from any optimal valid sequence P and
rewrite it; each rewrite keeps P valid and does not raise its energy, runtime, storage or peak RAM.

 (R1) Useless materializations go. Call a resident copy (the residency of n from a compute or
      page_in of n to the next free of n) *read* if some later compute in that residency has n as a
      dep. Delete every compute that is not the first computation of its node and whose copy is
      never read and never paged out, and every page_in whose copy is never read (with the frees
      ending those copies). Nothing read them, so every other step stays valid; RAM after each
      remaining step can only drop; energy and time only drop. Repeat until none is left (each round
      deletes steps, so it ends). So: every recomputation and every page-in in P is read later.
 (R2) Page-outs happen once per node, right after its first computation. A page_out of a node
      already stored changes nothing (the storage copy persists) and costs >= 0: delete it. A
      page_out whose copy is never paged in afterwards: delete it (storage only shrinks). Else, the
      copy paged out came from a compute (not a page_in: then the node was already stored). The
      deterministic first computation of the same node makes the same tensor, so move the page_out
      right after the first computation (it is resident then): same cost, same storage set, and the
      storage copy only exists earlier, which no rule forbids.
 (R3) Frees happen as early as possible: right after the last compute that reads that copy, or
      right after the copy is made (and paged out, by R2) when nothing reads it. Moving a free
      earlier, to a point where the copy is still resident and nothing later reads it, leaves every
      later step valid ("n not resident" before a compute of n only gets easier) and RAM at every
      measurement can only drop. By R1 a page-in's copy is always read, so no free follows a
      page_in directly: frees are attached to computes, and each one frees some of the compute's
      deps and its own output. That is all the freedom the search branches on (at most 2^4 choices
      with 3 deps).
 (R4) Under R1-R3, a tensor the future can no longer read is never resident. After the first
      computations in C, every later compute in P is either the first computation of a node outside
      C or (R1, by induction from the end) a recomputation whose copy some later compute reads: so
      every later compute is of a node in A = the nodes outside C and their ancestors (in ``paging``
      and ``none`` modes, with no recomputation: the nodes outside C alone). A copy of x can be read
      later only if x is a dep of a node in A; call that set NEED(C). By R3 a resident copy outside
      NEED(C) would already have been freed, so the search frees those right away (and never
      recomputes or pages in a node outside NEED(C), never pages out one outside NEED(C u {n})).
      The stored set then matters only on NEED(C) for what comes next (page_in needs x in NEED(C);
      a later page_out is of a node outside C), so states are keyed on S & NEED(C); the storage
      bytes already used are a label dimension when the storage budget is finite.
 (R5) A recomputed copy is never freed right after it is made (R1: it is read later).

None of R1-R5 relies on costs beyond non-negativity of energy, time and bytes.
``tests/test_exhaustive_sequences.py`` also checks the search against a plain Dijkstra over the four
raw steps with no reduction at all (:func:`naive_optimum`) on graphs small enough for it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

MODES = ("joint", "remat", "paging", "none")


@dataclass
class SearchResult:
    energy_j: float
    runtime_s: float
    storage_bytes: int
    steps: list  # [{"op": ..., "node": id}, ...], replayable under docs/schedule-format.md
    expanded: int = 0  # labels expanded
    pushed: int = 0
    first_order: list = field(default_factory=list)  # order of first computations in `steps`


def true_optimum(graph, costs, ram_bytes, runtime_s=math.inf, mode="joint", storage_bytes=math.inf,
                 first_order=None):
    """Minimum total energy over all valid step sequences, or None when none exists."""
    result = optimal_sequence(graph, costs, ram_bytes, runtime_s, mode, storage_bytes, first_order)
    return None if result is None else result.energy_j


def optimal_sequence(graph, costs, ram_bytes, runtime_s=math.inf, mode="joint", storage_bytes=math.inf,
                     first_order=None) -> SearchResult | None:
    """One optimal step sequence with its energy, runtime and storage (a SearchResult), or None."""
    return _Search(graph, costs, mode, first_order).run(ram_bytes, runtime_s, storage_bytes)


def min_feasible_ram(graph, mode="joint", first_order=None) -> int:
    """The smallest RAM budget at which some valid sequence exists (no runtime or storage limit):
    the same search with the peak RAM as its key (a bottleneck shortest path; the peak is
    non-decreasing along a path, so the first goal popped has the least peak)."""
    return _Search(graph, None, mode, first_order).min_peak()


class _Search:
    def __init__(self, graph, costs, mode, first_order):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        nodes = graph.nodes
        self.T = T = len(nodes)
        self.full = (1 << T) - 1
        self.remat = mode in ("joint", "remat")
        self.paging = mode in ("joint", "paging")
        self.size = [int(n.bytes) for n in nodes]
        self.deps = [0] * T
        for n in nodes:
            for d in n.deps:
                self.deps[n.id] |= 1 << d
        # ancestors-or-self, through the deps (ids are topological, so one pass)
        self.anc = [0] * T
        for n in range(T):
            m = 1 << n
            for d in range(T):
                if self.deps[n] >> d & 1:
                    m |= self.anc[d]
            self.anc[n] = m
        if costs is not None:
            f = lambda a: [float(x) for x in a]  # noqa: E731
            self.cj, self.cs = f(costs.compute_j), f(costs.compute_s)
            self.ij, self.is_ = f(costs.page_in_j), f(costs.page_in_s)
            self.oj, self.os = f(costs.page_out_j), f(costs.page_out_s)
            if min(self.cj + self.cs + self.ij + self.is_ + self.oj + self.os, default=0.0) < 0:
                raise ValueError("negative costs: the reductions assume non-negative energy and time")
        if first_order is not None:
            first_order = [int(n) for n in first_order]
            if sorted(first_order) != list(range(T)):
                raise ValueError("first_order must be a permutation of the node ids")
            seen = 0
            for n in first_order:
                if self.deps[n] & ~seen:
                    raise ValueError(f"first_order computes node {n} before one of its deps")
                seen |= 1 << n
        self.first_order = first_order
        self._need: dict[int, int] = {}
        self._rest: dict[int, tuple[float, float]] = {}
        self._strict: dict[int, int] = {}

    def need(self, C: int) -> int:
        """NEED(C) of reduction R4: the tensors some future compute may still read."""
        got = self._need.get(C)
        if got is None:
            todo = self.full & ~C
            A = 0
            if self.remat:
                m = todo
                while m:
                    low = m & -m
                    A |= self.anc[low.bit_length() - 1]
                    m ^= low
            else:
                A = todo
            got = 0
            while A:
                low = A & -A
                got |= self.deps[low.bit_length() - 1]
                A ^= low
            self._need[C] = got
        return got

    def rest(self, C: int) -> tuple[float, float]:
        """Energy and time of the first computations still to come: the A* heuristic and a
        runtime lower bound."""
        got = self._rest.get(C)
        if got is None:
            todo = [n for n in range(self.T) if not C >> n & 1]
            got = (math.fsum(self.cj[n] for n in todo), math.fsum(self.cs[n] for n in todo))
            self._rest[C] = got
        return got

    def bytes_of(self, m: int) -> int:
        total, size = 0, self.size
        while m:
            low = m & -m
            total += size[low.bit_length() - 1]
            m ^= low
        return total

    def moves(self, C, R, S, ram_used, ram_bytes):
        """Macro-steps from a state (R6: page-ins right before the compute that reads them; R3:
        frees right after it), as (steps, C', R', S' & NEED(C'), RAM after, node, paged-in mask,
        paged out?, peak RAM of the macro-step)."""
        T, deps, size = self.T, self.deps, self.size
        need = self.need(C)
        fo = self.first_order
        next_first = None if fo is None or C == self.full else fo[bin(C).count("1")]
        for n in range(T):
            bit = 1 << n
            if R & bit:
                continue
            missing = deps[n] & ~R
            if missing and (not self.paging or missing & ~S):
                continue
            first = not C & bit
            if first:
                if next_first is not None and n != next_first:
                    continue
            elif not (self.remat and need & bit):  # R4: a recomputation nobody can read
                continue
            peak = ram_used + (self.bytes_of(missing) if missing else 0) + size[n]
            if peak > ram_bytes:
                continue
            C2 = C | bit
            need2 = need if not first else self.need(C2)
            R_after = R | missing | bit
            gone = R_after & ~need2  # R4: what no future compute can read goes now
            choosable = (deps[n] | bit) & need2 & R_after
            if not first:
                choosable &= ~bit  # R5
            head = [("page_in", d) for d in self.members(missing)]
            head.append(("compute", n))
            outs = (False, True) if first and self.paging and need2 & bit else (False,)
            for out in outs:
                sub = choosable
                while True:
                    F = sub | gone
                    steps = head + [("page_out", n)] if out else list(head)
                    steps.extend(("free", x) for x in self.members(F))
                    S2 = (S | bit) if out else S
                    yield (steps, C2, R_after & ~F, S2 & need2, peak - self.bytes_of(F), n, missing, out, peak)
                    if sub == 0:
                        break
                    sub = (sub - 1) & choosable

    def members(self, m):
        out = []
        while m:
            low = m & -m
            out.append(low.bit_length() - 1)
            m ^= low
        return out

    def lower_bound(self, C, R, S):
        """(energy, time) still to spend at least, or None when the state is a dead end: the first
        computations still to come, plus one materialization (a recomputation, or a page-in when
        stored) of each computed tensor that some uncomputed node reads and that is not resident.
        Admissible (those are distinct steps each costing at least that), and consistent: a term
        leaves only when its tensor is materialized by the move that pays for it, or when its last
        uncomputed reader is computed, which needed it resident."""
        e, t = self.rest(C)
        missing = self.strict(C) & C & ~R
        for x in self.members(missing):
            if S >> x & 1 and self.paging:
                if self.remat:
                    e += min(self.cj[x], self.ij[x])
                    t += min(self.cs[x], self.is_[x])
                else:
                    e += self.ij[x]
                    t += self.is_[x]
            elif self.remat:
                e += self.cj[x]
                t += self.cs[x]
            else:
                return None
        return e, t

    def strict(self, C):
        got = self._strict.get(C)
        if got is None:
            got = 0
            for n in self.members(self.full & ~C):
                got |= self.deps[n]
            self._strict[C] = got
        return got

    def run(self, ram_bytes, runtime_s, storage_bytes):
        track_t = math.isfinite(runtime_s)
        track_st = math.isfinite(storage_bytes)
        runtime_cap = runtime_s * (1 + 1e-12) if track_t else math.inf
        cj, cs, ij, is_, oj, os_ = self.cj, self.cs, self.ij, self.is_, self.oj, self.os
        size = self.size
        # labels, in parallel lists: energy, time, storage, state, parent label, steps from the parent
        L_e, L_t, L_st, L_state, L_parent, L_steps = [], [], [], [], [], []
        settled: dict = {}  # state -> [(time, storage)] of the labels expanded there
        pushed: dict = {}  # state -> best energy, or [(energy, time, storage)], pushed so far
        heap = []

        def push(e, t, st, state, parent, steps):
            if st > storage_bytes:
                return
            bound = self.lower_bound(state[0], state[1], state[2])
            if bound is None or t + bound[1] > runtime_cap:
                return
            if not (track_t or track_st):
                old = pushed.get(state)
                if old is not None and old <= e:
                    return
                pushed[state] = e
            else:
                lst = pushed.setdefault(state, [])
                for e0, t0, s0 in lst:
                    if e0 <= e and t0 <= t and s0 <= st:
                        return
                lst.append((e, t, st))
            lid = len(L_e)
            L_e.append(e), L_t.append(t), L_st.append(st), L_state.append(state)
            L_parent.append(parent), L_steps.append(steps)
            heapq.heappush(heap, (e + bound[0], e, t, lid))

        push(0.0, 0.0, 0, (0, 0, 0, 0), -1, [])
        expanded = 0
        while heap:
            _, e, t, lid = heapq.heappop(heap)
            state = L_state[lid]
            st = L_st[lid]
            C, R, S, ram_used = state
            if track_t or track_st:
                done = settled.setdefault(state, [])
                if any(t0 <= t and s0 <= st for t0, s0 in done):
                    continue
                done.append((t, st))
            else:
                if state in settled:
                    continue
                settled[state] = True
            expanded += 1
            if C == self.full:
                return self._result(lid, L_parent, L_steps, expanded, len(L_e))
            for steps, C2, R2, S2, ram2, n, paged_in, out, _peak in self.moves(C, R, S, ram_used, ram_bytes):
                e2, t2, st2 = e + cj[n], t + cs[n], st
                for d in self.members(paged_in):
                    e2, t2 = e2 + ij[d], t2 + is_[d]
                if out:
                    e2, t2 = e2 + oj[n], t2 + os_[n]
                    if track_st:
                        st2 += size[n]
                if not track_t:
                    t2 = 0.0
                push(e2, t2, st2, (C2, R2, S2, ram2), lid, steps)
        return None

    def _result(self, lid, L_parent, L_steps, expanded, pushed):
        chunks = []
        k = lid
        while k >= 0:
            chunks.append(L_steps[k])
            k = L_parent[k]
        steps = [{"op": op, "node": n} for chunk in reversed(chunks) for op, n in chunk]
        energy = runtime = 0.0
        parts_e, parts_t, stored = [], [], set()
        firsts, seen = [], set()
        for s in steps:
            op, n = s["op"], s["node"]
            if op == "compute":
                parts_e.append(self.cj[n]), parts_t.append(self.cs[n])
                if n not in seen:
                    seen.add(n), firsts.append(n)
            elif op == "page_in":
                parts_e.append(self.ij[n]), parts_t.append(self.is_[n])
            elif op == "page_out":
                parts_e.append(self.oj[n]), parts_t.append(self.os[n])
                stored.add(n)
        energy, runtime = math.fsum(parts_e), math.fsum(parts_t)
        return SearchResult(energy, runtime, sum(self.size[n] for n in stored), steps, expanded, pushed, firsts)

    def min_peak(self):
        """Bottleneck Dijkstra: key = peak RAM so far. Uses the same moves (R1-R5 keep the peak from
        rising, so they are exact for this objective too)."""
        heap = [(0, (0, 0, 0, 0))]
        best = {(0, 0, 0, 0): 0}
        done = set()
        while heap:
            peak, state = heapq.heappop(heap)
            if state in done:
                continue
            done.add(state)
            C, R, S, ram_used = state
            if C == self.full:
                return peak
            for _steps, C2, R2, S2, ram2, _n, _in, _out, step_peak in self.moves(C, R, S, ram_used, math.inf):
                state2 = (C2, R2, S2, ram2)
                p2 = max(peak, step_peak)
                if best.get(state2, math.inf) > p2:
                    best[state2] = p2
                    heapq.heappush(heap, (p2, state2))
        return None


def naive_optimum(graph, costs, ram_bytes, runtime_s=math.inf, mode="joint", storage_bytes=math.inf,
                  first_order=None, max_states=3_000_000):
    """The same optimum by plain Dijkstra over the four raw steps with no reduction at all: states
    (computed, resident, stored), Pareto labels (energy, runtime, storage). Exponential; for graphs
    of up to about 7 nodes. Returns None when no sequence exists."""
    T = len(graph.nodes)
    full = (1 << T) - 1
    size = [int(n.bytes) for n in graph.nodes]
    deps = [sum(1 << d for d in n.deps) for n in graph.nodes]
    remat, paging = mode in ("joint", "remat"), mode in ("joint", "paging")
    cj, cs = [float(x) for x in costs.compute_j], [float(x) for x in costs.compute_s]
    ij, is_ = [float(x) for x in costs.page_in_j], [float(x) for x in costs.page_in_s]
    oj, os_ = [float(x) for x in costs.page_out_j], [float(x) for x in costs.page_out_s]
    cap = runtime_s * (1 + 1e-12)

    def ram(R):
        return sum(size[i] for i in range(T) if R >> i & 1)

    heap = [(0.0, 0.0, 0, 0, 0, 0)]
    settled: dict = {}
    while heap:
        e, t, st, C, R, S = heapq.heappop(heap)
        labels = settled.setdefault((C, R, S), [])
        if any(t0 <= t and s0 <= st for t0, s0 in labels):
            continue
        labels.append((t, st))
        if len(settled) > max_states:
            raise RuntimeError("naive search: too many states")
        if C == full:
            return e
        k = bin(C).count("1")
        for n in range(T):
            bit = 1 << n
            # compute n
            if not R & bit and not deps[n] & ~R and (remat or not C & bit):
                if C & bit or first_order is None or first_order[k] == n:
                    if ram(R | bit) <= ram_bytes and t + cs[n] <= cap:
                        heapq.heappush(heap, (e + cj[n], t + cs[n], st, C | bit, R | bit, S))
            if R & bit:
                heapq.heappush(heap, (e, t, st, C, R & ~bit, S))  # free n
                if paging:  # page_out n
                    st2 = st if S & bit else st + size[n]
                    if st2 <= storage_bytes and t + os_[n] <= cap:
                        heapq.heappush(heap, (e + oj[n], t + os_[n], st2, C, R, S | bit))
            elif paging and S & bit and ram(R | bit) <= ram_bytes and t + is_[n] <= cap:
                heapq.heappush(heap, (e + ij[n], t + is_[n], st, C, R | bit, S))  # page_in n
    return None


def schedule_document(graph, costs, steps, *, ram_bytes, runtime_s=math.inf, storage_bytes=None,
                      totals=None, mode="joint"):
    """A minimal `poet-opt/schedule@1` document for the validator: graph, budgets, steps, totals.
    totals: what the caller claims (default: summed here from the steps, independently of the
    validator's replay)."""
    nodes = []
    for node in graph.nodes:
        n = node.id
        nodes.append({
            "id": n, "name": node.name, "kind": node.kind, "op": node.op, "bytes": int(node.bytes),
            "deps": list(node.deps), "flops": node.flops, "param_bytes": node.param_bytes,
            "trainable": node.trainable,
            "compute_s": float(costs.compute_s[n]), "compute_j": float(costs.compute_j[n]),
            "page_out_s": float(costs.page_out_s[n]), "page_out_j": float(costs.page_out_j[n]),
            "page_in_s": float(costs.page_in_s[n]), "page_in_j": float(costs.page_in_j[n]),
        })
    if totals is None:
        totals = _totals(graph, costs, steps)
    return {
        "format": "poet-opt/schedule@1", "generator": "tests/exhaustive_sequences.py", "model": graph.name,
        "mode": mode, "graph": {"name": graph.name, "nodes": nodes},
        "budgets": {"ram_bytes": int(ram_bytes), "runtime_s": None if not math.isfinite(runtime_s) else runtime_s,
                    "storage_bytes": None if storage_bytes is None or not math.isfinite(storage_bytes)
                    else int(storage_bytes)},
        "steps": [dict(s) for s in steps], "totals": totals,
    }


def _totals(graph, costs, steps):
    e = {"compute": [], "page_in": [], "page_out": []}
    t = []
    resident, stored = set(), set()
    live = peak = 0
    counts = {"compute": 0, "page_in": 0, "page_out": 0, "free": 0}
    for s in steps:
        op, n = s["op"], s["node"]
        counts[op] += 1
        if op != "free":
            e[op].append(float(getattr(costs, f"{op}_j")[n]))
            t.append(float(getattr(costs, f"{op}_s")[n]))
        if op in ("compute", "page_in"):
            resident.add(n)
            live += graph.nodes[n].bytes
            peak = max(peak, live)
        elif op == "free":
            resident.discard(n)
            live -= graph.nodes[n].bytes
        else:
            stored.add(n)
    cj, ij, oj = (math.fsum(e[k]) for k in ("compute", "page_in", "page_out"))
    return {
        "energy_j": math.fsum(e["compute"] + e["page_in"] + e["page_out"]), "compute_j": cj, "page_in_j": ij,
        "page_out_j": oj, "runtime_s": math.fsum(t), "peak_ram_bytes": int(peak),
        "storage_bytes": int(sum(graph.nodes[n].bytes for n in stored)), "computes": counts["compute"],
        "recomputes": counts["compute"] - len(graph.nodes), "page_ins": counts["page_in"],
        "page_outs": counts["page_out"],
    }
