"""Execution orders: the sequence in which a training graph's nodes are first computed.

The solver's formulation fixes this order (stage t computes node t for the first time), so the
order is part of the answer: the same graph numbered differently can need more RAM at its peak, and
then more recomputation or paging under the same budget. These functions propose orders that hold
less in RAM at once, for the solver to try beside the one the graph came in.

An order is a list of node ids of the graph, each once, every node after its inputs.
"""

from __future__ import annotations

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


def low_memory_order(graph: TrainingGraph) -> list[int]:
    """A greedy list schedule: of the nodes whose inputs are all computed, run the one that leaves
    the fewest bytes live afterwards (its output, less the inputs it was the last reader of), the
    given order breaking ties. Gradients then run as soon as they can and release the activations
    they were holding, and a branch that only makes memory is put off until it is needed."""
    n = len(graph)
    users = graph.users()
    waiting_users = [len(set(u)) for u in users]
    missing = [len(set(node.deps)) for node in graph.nodes]
    ready = [i for i in range(n) if missing[i] == 0]
    order: list[int] = []
    while ready:
        # re-scored every time: what a node releases depends on what ran since it became ready
        i = min(ready, key=lambda j: (_growth(graph, j, waiting_users), j))
        ready.remove(i)
        order.append(i)
        for d in set(graph.nodes[i].deps):
            waiting_users[d] -= 1
        for u in set(users[i]):
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    return order


def _growth(graph: TrainingGraph, i: int, waiting_users: list[int]) -> int:
    node = graph.nodes[i]
    released = sum(graph.nodes[d].bytes for d in set(node.deps) if waiting_users[d] == 1)
    return node.bytes - released


def min_peak_order(graph: TrainingGraph, max_states: int = MAX_DP_STATES) -> Optional[list[int]]:
    """An order with the least plain-training peak, exactly, by dynamic programming over the sets
    of computed nodes (each set's live bytes do not depend on the order that computed it); None when
    the graph has more than ``max_states`` such sets."""
    n = len(graph)
    deps = [sorted(set(node.deps)) for node in graph.nodes]
    deps_mask = [sum(1 << d for d in deps[i]) for i in range(n)]
    users_mask = [sum(1 << u for u in set(users)) for users in graph.users()]
    size = [node.bytes for node in graph.nodes]

    # set -> (peak, live bytes, previous set, last node); a computed tensor is live while some
    # reader has not run, and one that nobody reads goes at once
    best: dict[int, tuple[int, int, int, int]] = {0: (0, 0, -1, -1)}
    frontier = [0]
    for _ in range(n):
        following: dict[int, tuple[int, int, int, int]] = {}
        for done in frontier:
            peak, held = best[done][:2]
            for v in range(n):
                if done >> v & 1 or deps_mask[v] & ~done:
                    continue
                nxt = done | 1 << v
                step_peak = max(peak, held + size[v])
                if nxt in following and (step_peak, v) >= (following[nxt][0], following[nxt][3]):
                    continue
                after = held + (size[v] if users_mask[v] else 0)
                after -= sum(size[d] for d in deps[v] if not users_mask[d] & ~nxt)
                following[nxt] = (step_peak, after, done, v)
        best.update(following)
        if len(best) > max_states:
            return None
        frontier = list(following)
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


def candidate_orders(graph: TrainingGraph, *, enumerate_up_to: int = 0) -> list[tuple[str, list[int]]]:
    """Orders worth solving in, each once, labelled: ``given`` first, then the least plain-training
    peak (exact where the graph is small enough) and ``low-memory``'s greedy where they hold less
    than the given order, and, when the graph has at most ``enumerate_up_to`` topological orders,
    every one of them."""
    given = list(range(len(graph)))
    candidates = [("given", given)]
    # an order that holds no less than the given one at plain training's peak would only take time
    # from it: the zoo's orders are already the least-peak ones, and their large MILPs need the time
    given_peak = graph.plain_peak_bytes()
    exact = min_peak_order(graph)
    if exact is not None and plain_peak(graph, exact) < given_peak:
        candidates.append(("min-peak", exact))
    greedy = low_memory_order(graph)
    if plain_peak(graph, greedy) < given_peak:
        candidates.append(("low-memory", greedy))
    if enumerate_up_to > 0:
        every = topological_orders(graph, enumerate_up_to)
        if every is not None:
            candidates += [(f"enumerated {k + 1}/{len(every)}", o) for k, o in enumerate(every)]
    seen: set[tuple[int, ...]] = set()
    unique = []
    for label, order in candidates:
        key = tuple(order)
        if key not in seen:
            seen.add(key)
            unique.append((label, order))
    return unique
