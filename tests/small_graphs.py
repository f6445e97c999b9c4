"""Random small training graphs (at most 11 nodes), their numberings, and a hypothesis strategy.

A graph is a random forward DAG of 2-5 nodes (node 0 reads nothing; every later node reads 1-3
earlier ones, so there are branches and skips), a loss reading the forward nodes nobody else reads,
and a mirrored backward pass: one backward node per forward node (the input node's optional), which
reads the gradients flowing in from its users' backward nodes (the loss, for the nodes the loss
reads) and the forward tensors its operator needs (any subset of its own output and its inputs).
Output sizes span 64x (64 B - 4 KiB) and FLOP counts 100x (1e4 - 1e6), and some nodes have zero
bytes or zero FLOPs. The costs come from a device profile (poet_opt.device.costs.node_costs).

The solver's answer depends on the numbering (stage t computes node t first), so there are helpers
to renumber a graph in a uniformly random topological order or in every topological order.
"""

from __future__ import annotations

import random
from dataclasses import replace
from functools import lru_cache

from poet_opt.model.graph import Node, TrainingGraph

SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # 64x
FLOPS = (1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6)  # 100x
MAX_NODES = 11


class _RandomPicker:
    """The choices the builder makes, from a random.Random."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def int(self, lo, hi):
        return self.rng.randint(lo, hi)

    def chance(self, p):
        return self.rng.random() < p

    def choice(self, seq):
        return self.rng.choice(list(seq))

    def subset(self, seq, k):
        return sorted(self.rng.sample(list(seq), k))


class _DrawPicker:
    """The same choices, drawn by hypothesis (so failing graphs shrink)."""

    def __init__(self, draw):
        from hypothesis import strategies as st
        self.draw, self.st = draw, st

    def int(self, lo, hi):
        return self.draw(self.st.integers(lo, hi))

    def chance(self, p):
        return self.draw(self.st.integers(0, 99)) < round(100 * p)

    def choice(self, seq):
        return self.draw(self.st.sampled_from(list(seq)))

    def subset(self, seq, k):
        seq = list(seq)
        picked = self.draw(self.st.lists(self.st.sampled_from(seq), min_size=k, max_size=k, unique=True))
        return sorted(picked)


def _build(pick, *, n_forward=None, name="small", zero_prob=0.15, max_nodes=MAX_NODES) -> TrainingGraph:
    nf = pick.choice((2, 3, 4, 5, 5)) if n_forward is None else n_forward
    if not 2 <= nf <= 5:
        raise ValueError("2-5 forward nodes")

    def size():
        return 0 if pick.chance(zero_prob) else pick.choice(SIZES)

    def flops():
        return 0.0 if pick.chance(zero_prob) else pick.choice(FLOPS)

    input_is_data = pick.chance(0.5)  # an "input" op: loading the sample costs a page-in (costs.py)
    nodes = [Node(0, "x" if input_is_data else "f0", "forward", size(), (), 0.0 if input_is_data else flops(),
                  "input" if input_is_data else "op")]
    for k in range(1, nf):
        fan_in = min(k, pick.choice((1, 1, 1, 2, 3)))
        deps = {k - 1} if pick.chance(0.2) else set()  # partly a chain, with branches around it
        rest = [d for d in range(k) if d not in deps]
        need = fan_in - len(deps)
        if need > 0:
            deps.update(pick.subset(rest, min(need, len(rest))))
        nodes.append(Node(k, f"f{k}", "forward", size(), tuple(sorted(deps)), flops(), "op"))
    users = {k: [n.id for n in nodes if k in n.deps] for k in range(nf)}
    sinks = [k for k in range(nf) if not users[k]]
    loss = nf
    nodes.append(Node(loss, "loss", "loss", pick.choice((0, 4, 64)), tuple(sinks), flops(), "loss"))

    room = max_nodes - len(nodes)
    grads = [f for f in range(nf - 1, -1, -1)]
    if input_is_data or len(grads) > room:  # no gradient for the data (and stay within max_nodes)
        grads = [f for f in grads if f != 0]
    grads = grads[:room]
    grad_of: dict[int, int] = {}
    next_id = loss + 1
    for f in grads:  # users before their inputs: reverse topological order
        incoming = {grad_of[u] for u in users[f] if u in grad_of}
        if f in sinks or not incoming:
            incoming.add(loss)
        saved = [x for x in (f, *nodes[f].deps) if pick.chance(0.5)]
        b_size = nodes[f].bytes if pick.chance(0.5) else size()
        nodes.append(Node(next_id, f"grad:{nodes[f].name}", "backward", b_size, tuple(sorted(incoming | set(saved))),
                          flops(), "grad"))
        grad_of[f] = next_id
        next_id += 1
    return TrainingGraph.build(name, nodes)


def random_small_graph(seed: int | random.Random, **kw) -> TrainingGraph:
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    name = kw.pop("name", f"small-{seed}" if not isinstance(seed, random.Random) else "small")
    return _build(_RandomPicker(rng), name=name, **kw)


def training_graphs(n_forward=None, zero_prob=0.15):
    """Hypothesis strategy for the same graphs (each choice drawn, so examples shrink)."""
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw):
        return _build(_DrawPicker(draw), n_forward=n_forward, zero_prob=zero_prob, name="hypothesis")

    return strategy()


# ---- numberings ----------------------------------------------------------------------------------

def renumber(graph: TrainingGraph, order) -> TrainingGraph:
    """The same graph with node order[k] as node k (order must be topological)."""
    order = list(order)
    if sorted(order) != list(range(len(graph))):
        raise ValueError("order must be a permutation of the node ids")
    new = {old: k for k, old in enumerate(order)}
    for old in order:
        if any(new[d] >= new[old] for d in graph.nodes[old].deps):
            raise ValueError(f"order is not topological at node {old}")
    nodes = [replace(graph.nodes[old], id=k, deps=tuple(sorted(new[d] for d in graph.nodes[old].deps)))
             for k, old in enumerate(order)]
    out = TrainingGraph(name=graph.name, nodes=tuple(nodes), meta=dict(graph.meta))
    return out


def _dep_masks(graph):
    return tuple(sum(1 << d for d in n.deps) for n in graph.nodes)


@lru_cache(maxsize=4096)
def _count(deps: tuple, done: int) -> int:
    """Number of linear extensions of the nodes not in `done`."""
    T = len(deps)
    if done == (1 << T) - 1:
        return 1
    return sum(_count(deps, done | 1 << n) for n in range(T)
               if not done >> n & 1 and not deps[n] & ~done)


def count_topological_orders(graph) -> int:
    return _count(_dep_masks(graph), 0)


def random_topological_order(graph, rng: random.Random) -> list[int]:
    """A topological order drawn uniformly among all of them (each next node is drawn with weight
    the number of orders that continue from it)."""
    deps = _dep_masks(graph)
    done, order = 0, []
    for _ in range(len(deps)):
        ready = [n for n in range(len(deps)) if not done >> n & 1 and not deps[n] & ~done]
        weights = [_count(deps, done | 1 << n) for n in ready]
        n = rng.choices(ready, weights)[0]
        order.append(n)
        done |= 1 << n
    return order


def all_topological_orders(graph):
    """Every topological order (generator; there are at most a few thousand at 11 nodes here)."""
    deps = _dep_masks(graph)
    T = len(deps)

    def walk(done, prefix):
        if len(prefix) == T:
            yield list(prefix)
            return
        for n in range(T):
            if not done >> n & 1 and not deps[n] & ~done:
                prefix.append(n)
                yield from walk(done | 1 << n, prefix)
                prefix.pop()

    yield from walk(0, [])


def randomly_renumbered(graph, rng: random.Random) -> tuple[TrainingGraph, list[int]]:
    order = random_topological_order(graph, rng)
    return renumber(graph, order), order
