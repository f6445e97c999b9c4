"""Execution orders: the sequence in which a training graph's nodes are first computed.

The solver's formulation fixes this order (stage t computes node t for the first time), so the
order is part of the answer: the same graph numbered differently can need more RAM at its peak, and
then more recomputation or paging under the same budget. These functions propose orders that hold
less in RAM at once, for the solver to try beside the one the graph came in.

An order is a list of node ids of the graph, each once, every node after its inputs.
"""

from __future__ import annotations

import heapq
import random
import time
from typing import Optional

from poet_opt.model.graph import TrainingGraph

# Subset dynamic programs visit the graph's downward-closed node sets; training graphs are close
# to chains, so these stay few, but a wide graph could have exponentially many.
MAX_DP_STATES = 20_000


def is_topological(graph: TrainingGraph, order) -> bool:
    if sorted(order) != list(range(len(graph))):
        return False
    position = {n: k for k, n in enumerate(order)}
    return all(position[d] < position[n.id] for n in graph.nodes for d in n.deps)


def plain_peak(graph: TrainingGraph, order) -> int:
    """Peak bytes of plain training in this order: each node computed once, each tensor freed
    right after its last reader."""
    return graph.reordered(order).plain_peak_bytes()


def low_memory_order(graph: TrainingGraph, deadline: Optional[float] = None) -> Optional[list[int]]:
    """A greedy list schedule: of the nodes whose inputs are all computed, run the one that leaves
    the fewest bytes live afterwards (its output, less the inputs it was the last reader of), the
    given order breaking ties. Gradients then run as soon as they can and release the activations
    they were holding, and a branch that only makes memory is put off until it is needed. None when
    ``time.perf_counter()`` passes ``deadline`` first.

    A node's score only falls, and only when one of its inputs is left with it as its last waiting
    reader; a heap re-scores just that node then, and drops stale entries as they surface. Scanning
    every ready node at each pick instead was quadratic: a row-tiled bert-base keeps thousands of
    weight nodes ready all along, 67 s at 57,843 nodes."""
    n = len(graph)
    users = [sorted(set(u)) for u in graph.users()]
    waiting_users = [len(u) for u in users]
    missing = [len(set(node.deps)) for node in graph.nodes]
    done = [False] * n
    heap = [(_growth(graph, i, waiting_users), i) for i in range(n) if missing[i] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        if deadline is not None and len(order) % 256 == 0 and time.perf_counter() > deadline:
            return None
        growth, i = heapq.heappop(heap)
        if done[i] or growth != _growth(graph, i, waiting_users):
            continue  # run already, or re-scored lower since this entry was pushed
        done[i] = True
        order.append(i)
        for d in set(graph.nodes[i].deps):
            waiting_users[d] -= 1
            if waiting_users[d] == 1:  # its last waiting reader now releases it: score that one again
                last = next(u for u in users[d] if not done[u])
                if missing[last] == 0:
                    heapq.heappush(heap, (_growth(graph, last, waiting_users), last))
        for u in users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(heap, (_growth(graph, u, waiting_users), u))
    return order


def _growth(graph: TrainingGraph, i: int, waiting_users: list[int]) -> int:
    node = graph.nodes[i]
    released = sum(graph.nodes[d].bytes for d in set(node.deps) if waiting_users[d] == 1)
    return node.bytes - released


def min_peak_order(graph: TrainingGraph, max_states: int = MAX_DP_STATES,
                   deadline: Optional[float] = None) -> Optional[list[int]]:
    """An order with the least plain-training peak, exactly, by dynamic programming over the sets
    of computed nodes (each set's live bytes do not depend on the order that computed it); None when
    the graph has more than ``max_states`` such sets, or when ``time.perf_counter()`` passes
    ``deadline``. Work and memory stay linear in the states times the nodes ready in each: a graph
    has at least one set per node count, so one with more nodes than ``max_states`` is refused at
    once (a 100,000-node graph would otherwise hold 20,000 sets of 100,000 bits)."""
    n = len(graph)
    if n + 1 > max_states:
        return None
    deps = [sorted(set(node.deps)) for node in graph.nodes]
    deps_mask = [sum(1 << d for d in deps[i]) for i in range(n)]
    users = [sorted(set(u)) for u in graph.users()]
    users_mask = [sum(1 << u for u in us) for us in users]
    size = [node.bytes for node in graph.nodes]

    # set -> (peak, live bytes, previous set, last node); a computed tensor is live while some
    # reader has not run, and one that nobody reads goes at once
    best: dict[int, tuple[int, int, int, int]] = {0: (0, 0, -1, -1)}
    # the nodes ready after each set of the current level: only those are tried next
    ready_of = {0: tuple(v for v in range(n) if not deps_mask[v])}
    for level in range(n):
        if deadline is not None and level % 64 == 0 and time.perf_counter() > deadline:
            return None
        following: dict[int, tuple[int, int, int, int]] = {}
        ready_next: dict[int, tuple[int, ...]] = {}
        for done, ready in ready_of.items():
            # also within a level: a wide one (thousands of weights ready at once, as activation
            # strips make) takes seconds, and 64 of them minutes
            if deadline is not None and time.perf_counter() > deadline:
                return None
            peak, held = best[done][:2]
            for v in ready:
                nxt = done | 1 << v
                step_peak = max(peak, held + size[v])
                if nxt in following and (step_peak, v) >= (following[nxt][0], following[nxt][3]):
                    continue
                after = held + (size[v] if users_mask[v] else 0)
                after -= sum(size[d] for d in deps[v] if not users_mask[d] & ~nxt)
                following[nxt] = (step_peak, after, done, v)
                if nxt not in ready_next:  # the same for every way of reaching the set
                    ready_next[nxt] = tuple(r for r in ready if r != v) + tuple(
                        u for u in users[v] if not deps_mask[u] & ~nxt)
        best.update(following)
        if len(best) > max_states:
            return None
        ready_of = ready_next
    order: list[int] = []
    done = (1 << n) - 1
    while done:
        _, _, previous, v = best[done]
        order.append(v)
        done = previous
    return order[::-1]


def topological_orders(graph: TrainingGraph, limit: int) -> Optional[list[list[int]]]:
    """Every topological order of the graph, in lexicographic order, or None when there are more
    than ``limit``."""
    n = len(graph)
    users = [sorted(set(u)) for u in graph.users()]
    missing = [len(set(node.deps)) for node in graph.nodes]
    found: list[list[int]] = []
    prefix: list[int] = []
    ready = [i for i in range(n) if missing[i] == 0]

    def extend(ready: list[int]) -> bool:
        if len(prefix) == n:
            found.append(list(prefix))
            return len(found) <= limit
        for v in ready:
            prefix.append(v)
            opened = []
            for u in users[v]:
                missing[u] -= 1
                if missing[u] == 0:
                    opened.append(u)
            following = sorted([r for r in ready if r != v] + opened)
            go_on = extend(following)
            for u in users[v]:
                missing[u] += 1
            prefix.pop()
            if not go_on:
                return False
        return True

    return found if extend(ready) else None


def overflow(graph: TrainingGraph, order, ram_bytes: float) -> tuple[float, int, int]:
    """How far plain training in this order goes over a RAM budget: the bytes above it summed over
    the compute steps, the number of steps above it, and the peak. Each byte above the budget must
    be paged out or recomputed around that step, so an order with less of it usually needs less
    extra energy (a ranking, not a bound)."""
    deps = [set(node.deps) for node in graph.nodes]
    users = graph.users()
    waiting = [len(set(u)) for u in users]
    size = [node.bytes for node in graph.nodes]
    held = peak = steps = 0
    excess = 0.0
    for v in order:
        during = held + size[v]
        peak = max(peak, during)
        if during > ram_bytes:
            excess += during - ram_bytes
            steps += 1
        held = during if waiting[v] else held
        for d in deps[v]:
            waiting[d] -= 1
            if waiting[d] == 0:
                held -= size[d]
    return excess, steps, peak


def sampled_orders(graph: TrainingGraph, count: int, seed: int = 0,
                   deadline: Optional[float] = None) -> list[list[int]]:
    """Up to ``count`` distinct random topological orders (each ready node equally likely next), for
    graphs with too many orders to list: a sample to rank, not a search. Reproducible for a seed;
    fewer when ``time.perf_counter()`` passes ``deadline``."""
    rng = random.Random(seed)
    n = len(graph)
    users = [sorted(set(u)) for u in graph.users()]
    indegree = [len(set(node.deps)) for node in graph.nodes]
    found: dict[tuple[int, ...], None] = {}
    # duplicates are likely only when the graph has few orders: a bounded number of draws
    for _ in range(4 * count):
        if len(found) >= count or (deadline is not None and time.perf_counter() > deadline):
            break
        missing = list(indegree)
        ready = [i for i in range(n) if missing[i] == 0]
        order = []
        while ready:
            v = ready.pop(rng.randrange(len(ready)))
            order.append(v)
            for u in users[v]:
                missing[u] -= 1
                if missing[u] == 0:
                    ready.append(u)
        found.setdefault(tuple(order), None)
    return [list(o) for o in found]


def candidate_orders(graph: TrainingGraph, *, enumerate_up_to: int = 0, ram_bytes: Optional[float] = None,
                     rank_up_to: int = 0, deadline: Optional[float] = None,
                     sample: int = 0) -> list[tuple[str, list[int]]]:
    """Orders worth solving in, each once, labelled: ``given`` first, then the least plain-training
    peak (exact where the graph is small enough) and ``low-memory``'s greedy where they hold less
    than the given order, and, when the graph has at most ``enumerate_up_to`` topological orders,
    every one of them. With ``ram_bytes``, when the graph has more orders than that but at most
    ``rank_up_to``, the ``enumerate_up_to`` of them that go least over the budget in plain training
    (``overflow``); and the enumerated ones come in that rank, the likeliest first. With more orders
    than ``rank_up_to`` and ``sample`` > 0, ``sample`` random orders (``sampled_orders``) ranked the
    same way stand in for them. Past ``deadline`` (a ``time.perf_counter()`` value) the searches
    still running give up: fewer candidates, never a late answer."""
    given = list(range(len(graph)))
    candidates = [("given", given)]
    # an order that holds no less than the given one at plain training's peak would only take time
    # from it: the zoo's orders are already the least-peak ones, and their large MILPs need the time
    given_peak = graph.plain_peak_bytes()
    exact = min_peak_order(graph, deadline=deadline)
    if exact is not None and plain_peak(graph, exact) < given_peak:
        candidates.append(("min-peak", exact))
    greedy = low_memory_order(graph, deadline=deadline)
    if greedy is not None and plain_peak(graph, greedy) < given_peak:
        candidates.append(("low-memory", greedy))
    if enumerate_up_to > 0:
        every = topological_orders(graph, max(enumerate_up_to, rank_up_to if ram_bytes is not None else 0))
        if every is not None and ram_bytes is not None:
            # a stable sort: ties keep the lexicographic order
            ranked = sorted(range(len(every)), key=lambda k: overflow(graph, every[k], ram_bytes)[:2])
            candidates += [(f"ranked {r + 1}/{len(every)}", every[k])
                           for r, k in enumerate(ranked[:enumerate_up_to])]
        elif every is not None:
            candidates += [(f"enumerated {k + 1}/{len(every)}", o) for k, o in enumerate(every)]
        elif ram_bytes is not None and sample > 0:
            drawn = sampled_orders(graph, sample, deadline=deadline)
            ranked = sorted(range(len(drawn)), key=lambda k: overflow(graph, drawn[k], ram_bytes)[:2])
            candidates += [(f"sampled {r + 1}/{len(drawn)}", drawn[k])
                           for r, k in enumerate(ranked[:enumerate_up_to])]
    seen: set[tuple[int, ...]] = set()
    unique = []
    for label, order in candidates:
        key = tuple(order)
        if key not in seen:
            seen.add(key)
            unique.append((label, order))
    return unique
