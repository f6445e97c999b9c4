"""The execution order of a strip graph (model/strips.py) whose layers also have weight slices.

The plan follows the graph's node order, and the greedy low-memory order (model/orders.py) walks a
sliced layer strip by strip: for each strip of its input gradient it runs the partial sums of every
weight slice, so each slice is read from storage again for every strip. On ResNet-18 at 200 KiB
that was 136 MiB of re-reads per step, more than three times the weights (benchmarks/STREAMING.md).

The data gradient of a sliced layer is a grid: the node of strip j and slice k (``grad:x@sj+k``)
adds slice k's part to the partial sum of slice k - 1 for the same strip, after the node of strip
j - 1 and slice k (the readers of a slice's weights form a chain). Strip-major and slice-major are
both orders of that grid. Slice-major reads each slice once, but holds the partial sums of every
strip and the output-gradient strips they read between slices; where those are larger than the
RAM budget they are paged out and in for every slice instead. So the strips go in blocks: within a
block, slice-major; the block as large as its partial sums and output-gradient strips, beside the
largest weight slice, fit the budget. A layer's forward slices get the same blocks (the input
strips a block reads beside its slices' outputs). Deeper layers, where the weights dwarf the
activations, get one block (read each slice once); the stem, none (it has no slices).

The order is the low-memory one with those grids in blocks and each weight read right before its
first reader (the greedy order reads many weights long before their layer, only to read them again
there); every other node keeps its place as far as the dependencies allow. The maths is the graph's:
only the order changes (tests/test_strips.py replays the reordered graph against autograd).
"""

from __future__ import annotations

import heapq
from typing import Optional

from poet_opt.model.graph import TrainingGraph


def sliced_grids(graph: TrainingGraph, budget_bytes: int) -> dict[int, tuple]:
    """{node id: (grid, block, slice, strip)} for the data-gradient and forward nodes of sliced layers
    over strips: ``grid`` names the grid, ``slice`` is the position in the gradient's chain of
    partial sums (or the slice's index, forward)."""
    strips = graph.meta.get("strips")
    if strips is None:
        return {}
    tensors, records, layers, alias = strips.tensors, strips.nodes, strips.layers, strips.grad_alias
    tiles = graph.meta.get("tiles") or {}
    slice_of = {name: (layer, k) for layer, names in tiles.items() for k, name in enumerate(names)}
    by_name = {n.name: n for n in graph.nodes}
    strip_bytes: dict[str, int] = {}
    for n in graph.nodes:
        record = records.get(n.name)
        if record is not None and record.role == "forward" and record.rows is not None:
            strip_bytes[record.layer] = max(strip_bytes.get(record.layer, 0), n.bytes)

    def weight_bytes(layer: str) -> int:
        node = by_name.get(f"param:{layer}")
        return node.bytes if node is not None else 0

    def block(count: int, s_in: int, s_out: int, weights: int) -> int:
        # partial sums (or inputs) and output strips of a block, beside one slice: within the budget
        return max(1, min(count, (budget_bytes - weights) // max(1, s_in + s_out)))

    def strip_index(tensor: str, rows) -> int:
        return [tuple(r) for r in tensors[tensor]].index(tuple(rows))

    # one block size per grid, from its largest slice and output strips: blocks that differed from
    # slice to slice would interleave the blocks of a grid
    members: list[tuple[int, str, int, int]] = []
    sizes: dict[str, tuple[int, int, int, int]] = {}  # grid -> (strips, input strip, output strip, slice)

    def note(grid: str, count: int, s_in: int, s_out: int, weights: int) -> None:
        _, a, b, c = sizes.get(grid, (count, 0, 0, 0))
        sizes[grid] = (count, max(a, s_in), max(b, s_out), max(c, weights))

    depth: dict[str, int] = {}
    for n in graph.nodes:  # in a topological order: a partial sum after the one it extends
        record = records.get(n.name)
        if record is None:
            continue
        role, rows = record.role, record.rows
        if role == "grad" and rows is not None and record.of in tensors:
            depth[n.name] = 0 if record.prev is None else depth[record.prev] + 1
            weighted = [t for t in record.terms if t in layers and layers[t].params and t in slice_of]
            if not weighted:
                continue
            x = record.of
            note(f"grad:{x}", len(tensors[x]), strip_bytes.get(x, 0),
                 max(strip_bytes.get(alias.get(t, t), 0) for t in weighted), max(map(weight_bytes, weighted)))
            members.append((n.id, f"grad:{x}", depth[n.name], strip_index(x, rows)))
        elif role == "forward" and record.layer in slice_of and record.layer in tensors:
            name = record.layer
            layer, k = slice_of[name]
            (x,) = layers[name].inputs
            note(layer, len(tensors[name]), strip_bytes.get(x, 0), strip_bytes.get(layer, 0),
                 max(weight_bytes(t) for t in tiles[layer]))
            members.append((n.id, layer, k, strip_index(name, rows)))
    size = {grid: block(*figures) for grid, figures in sizes.items()}
    return {v: (grid, j // size[grid], k, j) for v, grid, k, j in members}


def slice_block_order(graph: TrainingGraph, budget_bytes: int, base: Optional[list[int]] = None) -> list[int]:
    """The order of the module's docstring: ``base`` (a topological order; the graph's own by
    default), with the sliced grids of ``sliced_grids`` in blocks and each ``param`` node pulled
    right before its first reader."""
    n = len(graph)
    base = list(range(n)) if base is None else base
    grids = sliced_grids(graph, budget_bytes)
    position = {v: k for k, v in enumerate(base)}
    first: dict[str, int] = {}  # a grid runs where its first node was
    for v, (grid, *_) in grids.items():
        first[grid] = min(first.get(grid, n), position[v])
    last = float(n)  # a param's own place never counts: it goes where its first reader goes
    key: dict[int, tuple] = {}
    for v in range(n):
        if v in grids:
            grid, block, k, j = grids[v]
            key[v] = (first[grid], block, k, j, v)
        elif graph.nodes[v].op == "param" and not graph.nodes[v].deps:
            key[v] = (last, 0, 0, 0, v)
        else:
            key[v] = (position[v], -1, 0, 0, v)
    users = graph.users()
    # a node's inputs run as soon as a reader that comes early needs them (the inputs of a block of
    # slices, the weights): each takes its earliest reader's key, just before it
    for v in sorted(range(n), key=lambda v: -position[v]):
        if users[v]:
            earliest = min(key[u] for u in users[v])
            if earliest < key[v]:
                key[v] = earliest[:-1] + (earliest[-1] - 0.5,)
    missing = [len(set(node.deps)) for node in graph.nodes]
    ready = [(key[v], v) for v in range(n) if not missing[v]]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, v = heapq.heappop(ready)
        order.append(v)
        for u in set(users[v]):
            missing[u] -= 1
            if not missing[u]:
                heapq.heappush(ready, (key[u], u))
    return order
