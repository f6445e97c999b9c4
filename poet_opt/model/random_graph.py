"""Seeded random training graphs, for property tests and scale benchmarks.

The forward part is a random DAG in which every node reads one or more earlier nodes (skip
connections included); the backward part follows the usual reverse-mode structure: the gradient of
a forward node reads the gradients of its readers, its own inputs and its own output.
"""

from __future__ import annotations

import random

from poet_opt.model.graph import Node, TrainingGraph


def random_training_graph(n_forward: int, seed: int = 0, *, max_fan_in: int = 2, skip_prob: float = 0.3,
                          size_choices=(1024, 2048, 4096, 8192), zero_cost_prob: float = 0.0) -> TrainingGraph:
    """n_forward forward nodes (the first is the input), a loss, and one gradient per non-input
    forward node: 2 * n_forward nodes in all."""
    if n_forward < 2:
        raise ValueError("need at least an input and one layer")
    rng = random.Random(seed)
    nodes: list[Node] = [Node(0, "input", "forward", rng.choice(size_choices), (), 0.0, "input")]
    for k in range(1, n_forward):
        deps = {k - 1}
        for _ in range(max_fan_in - 1):
            if k >= 2 and rng.random() < skip_prob:
                deps.add(rng.randrange(0, k - 1))
        flops = 0.0 if rng.random() < zero_cost_prob else float(rng.choice((1e4, 3e4, 1e5, 3e5, 1e6)))
        nodes.append(Node(k, f"f{k}", "forward", rng.choice(size_choices), tuple(sorted(deps)), flops, "op",
                          param_bytes=rng.choice((0, 4096)), trainable=True))
    loss = n_forward
    nodes.append(Node(loss, "loss", "loss", 4, (n_forward - 1,), 10.0, "loss"))

    readers: dict[int, list[int]] = {k: [] for k in range(n_forward)}
    for node in nodes[1:n_forward]:
        for d in node.deps:
            readers[d].append(node.id)
    grad_of: dict[int, int] = {}
    next_id = loss + 1
    for f in range(n_forward - 1, 0, -1):
        deps = {f, *nodes[f].deps}
        deps.update(grad_of[u] for u in readers[f])
        if f == n_forward - 1:
            deps.add(loss)
        size = nodes[f].bytes
        nodes.append(Node(next_id, f"grad:f{f}", "backward", size, tuple(sorted(deps)), 2 * nodes[f].flops, "grad"))
        grad_of[f] = next_id
        next_id += 1
    return TrainingGraph.build(f"random-n{n_forward}-s{seed}", nodes)
