"""Training graph: a DAG of operators, each producing one tensor.

Nodes are stored in a topological order and their ``id`` equals their position, so the solver and
the validator can index arrays by id. Builders (the model zoo, importers) hand in nodes with any
ids; :func:`TrainingGraph.build` checks the structure and renumbers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from poet_opt.errors import PoetError, shown
from poet_opt.units import MAX_BYTES

KINDS = ("forward", "loss", "backward")


@dataclass(frozen=True)
class Node:
    id: int
    name: str
    kind: str  # one of KINDS
    bytes: int  # size of the output tensor
    deps: tuple[int, ...] = ()
    flops: float = 0.0
    op: str = ""  # operator type (conv2d, linear, relu, ...); used by measured-cost overrides
    param_bytes: int = 0  # weights owned by this operator (counted once, outside the RAM budget)
    trainable: bool = False  # whether the weights get a gradient (another param_bytes)
    compute_s: float | None = None  # a measured time (imported graphs); overrides flops / throughput
    compute_j: float | None = None  # a measured energy (--costs); overrides the profile's energy model
    # Streamed weights (docs/streaming.md): ``param`` nodes (op "param") are a layer's weights or optimizer
    # state, read from storage when computed; the node that applies a layer's update lists those nodes
    # in ``updates``, changes them in place and writes ``writes_bytes`` back to storage as it runs.
    updates: tuple[int, ...] = ()
    writes_bytes: int = 0

    @property
    def is_backward(self) -> bool:
        return self.kind == "backward"


@dataclass(frozen=True)
class TrainingGraph:
    name: str
    nodes: tuple[Node, ...]
    meta: dict = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def edges(self) -> list[tuple[int, int]]:
        return [(d, n.id) for n in self.nodes for d in n.deps]

    def users(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for d in node.deps:
                out[d].append(node.id)
        return out

    def last_use(self) -> list[int]:
        """Index of the last consumer of each node (the node itself when nothing reads it)."""
        last = list(range(len(self.nodes)))
        for node in self.nodes:
            for d in node.deps:
                last[d] = max(last[d], node.id)
        return last

    @property
    def param_bytes(self) -> int:
        """Weights held outside the plan, resident for the whole step (streamed weights are nodes)."""
        return sum(n.param_bytes for n in self.nodes)

    @property
    def streamed_param_bytes(self) -> int:
        """Weights and optimizer state that live on storage and pass through RAM as ``param`` nodes."""
        return sum(n.bytes for n in self.nodes if n.op == "param")

    @property
    def streams_weights(self) -> bool:
        return any(n.op == "param" for n in self.nodes)

    def last_compute_stage(self) -> list[int]:
        """The last stage in which each node may be computed: a ``param`` node (a read of its weights)
        and every node that reads it must run before the node that updates those weights, or they
        would see the new weights; other nodes are unlimited (the last stage)."""
        last = [len(self.nodes) - 1] * len(self.nodes)
        users = self.users()
        for node in self.nodes:
            if node.updates:  # run again, it would read the weights it has just changed
                last[node.id] = min(last[node.id], node.id)
            for p in node.updates:
                last[p] = min(last[p], node.id)
                for reader in users[p]:
                    if reader != node.id:
                        last[reader] = min(last[reader], node.id)
        return last

    @property
    def param_grad_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes if n.trainable)

    def plain_peak_bytes(self) -> int:
        """Peak of live activation/gradient bytes when training plainly: every node computed once
        in order, each tensor freed right after its last consumer."""
        last = self.last_use()
        frees_after: list[list[int]] = [[] for _ in self.nodes]
        for i, t in enumerate(last):
            frees_after[t].append(i)
        live = peak = 0
        for node in self.nodes:
            live += node.bytes
            peak = max(peak, live)
            live -= sum(self.nodes[i].bytes for i in frees_after[node.id])
        return peak

    def min_working_set_bytes(self) -> int:
        """No schedule can go below this: some node and all its inputs must be resident at once."""
        return self.largest_working_set()[0]

    def largest_working_set(self) -> tuple[int, "Node"]:
        """min_working_set_bytes and the (first) node that sets it, for messages."""
        return max(((n.bytes + sum(self.nodes[d].bytes for d in set(n.deps)), n) for n in self.nodes),
                   key=lambda pair: pair[0])

    def reordered(self, order) -> "TrainingGraph":
        """The same graph with node k being node ``order[k]`` of this one (a topological order:
        every node after its inputs); names, sizes and costs move with their nodes."""
        new_id = {old: k for k, old in enumerate(order)}
        if len(new_id) != len(self.nodes) or sorted(new_id) != list(range(len(self.nodes))):
            raise ValueError("an order must list every node once")
        nodes = []
        for k, old in enumerate(order):
            node = self.nodes[old]
            deps = tuple(sorted({new_id[d] for d in node.deps}))
            if any(d >= k for d in deps):
                raise ValueError(f"node {node.name} comes before one of its inputs in this order")
            nodes.append(replace(node, id=k, deps=deps, updates=tuple(new_id[p] for p in node.updates)))
        meta = dict(self.meta)
        if meta.get("given_ids") is not None:  # by the ids of the graph it describes
            meta["given_ids"] = [meta["given_ids"][old] for old in order]
        return TrainingGraph(name=self.name, nodes=tuple(nodes), meta=meta)

    @staticmethod
    def build(name: str, nodes: Iterable[Node], *, source: str | None = None, meta: dict | None = None,
              given_ids: dict | None = None) -> "TrainingGraph":
        """Check the structure (unique ids, known deps, no cycle, sane sizes), then renumber into a
        topological order that keeps the given order wherever the dependencies allow.

        ``given_ids`` (a node's id here -> the id its user gave it, as in a graph file) are kept in
        ``meta["given_ids"]``, by the new ids, so that a schedule names the user's own nodes; so are
        those of a ``meta`` that already has them (a graph built on another: None for new nodes)."""
        nodes = list(nodes)
        if not nodes:
            raise PoetError("the graph has no nodes", source=source, field="nodes")
        by_id: dict[int, int] = {}
        for pos, node in enumerate(nodes):
            if node.id in by_id:
                raise PoetError(f"duplicate node id {node.id}", source=source, field="nodes.id")
            by_id[node.id] = pos
            if node.kind not in KINDS:
                raise PoetError(f"node {node.id} has kind {node.kind!r}; expected one of {', '.join(KINDS)}",
                                source=source, field="nodes.kind")
            for attr in ("bytes", "flops", "param_bytes", "writes_bytes"):
                value = getattr(node, attr)
                if not (value >= 0):  # also catches NaN
                    raise PoetError(f"node {node.id} ({node.name}) has {attr} = {value}; must be >= 0",
                                    source=source, field=f"nodes.{attr}")
            if node.compute_s is not None and not (node.compute_s >= 0):
                raise PoetError(f"node {node.id} ({node.name}) has a compute time of {node.compute_s}; must be >= 0",
                                source=source, field="nodes.cost_cpu")
            if node.compute_j is not None and not (node.compute_j >= 0):
                raise PoetError(f"node {node.id} ({node.name}) has a compute energy of {node.compute_j}; must be >= 0",
                                source=source, field="nodes.compute_j")
        total = sum(n.bytes for n in nodes)
        if total > MAX_BYTES:  # sums of sizes (peaks, budgets) must stay within 64-bit integers
            raise PoetError(f"the nodes' output sizes add up to {shown(total)} bytes, more than 2^63 - 1",
                            source=source, field="nodes.bytes")
        for node in nodes:
            for d in node.deps:
                if d not in by_id:
                    raise PoetError(f"edge {d} -> {node.id} refers to node {d}, which does not exist",
                                    source=source, field="links.source")
                if d == node.id:
                    raise PoetError(f"node {node.id} ({node.name}) depends on itself", source=source, field="links")
            for p in node.updates:  # an update changes weights it has read, in place
                if p not in node.deps or nodes[by_id[p]].op != "param":
                    raise PoetError(f"node {node.id} ({node.name}) updates node {p}, which is not a param node it reads",
                                    source=source, field="nodes.updates")
        order = _topological_order(nodes, by_id, source)
        new_id = {nodes[pos].id: k for k, pos in enumerate(order)}
        renumbered = []
        for k, pos in enumerate(order):
            node = nodes[pos]
            deps = tuple(sorted({new_id[d] for d in node.deps}))
            renumbered.append(replace(node, id=k, deps=deps, updates=tuple(new_id[p] for p in node.updates)))
        meta = dict(meta or {})
        if given_ids is None and meta.get("given_ids") is not None:
            given_ids = dict(enumerate(meta["given_ids"]))
        if given_ids is not None:
            meta["given_ids"] = [given_ids.get(nodes[pos].id) for pos in order]
        return TrainingGraph(name=name, nodes=tuple(renumbered), meta=meta)


def _topological_order(nodes: Sequence[Node], by_id: dict[int, int], source: str | None) -> list[int]:
    indegree = [0] * len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    for pos, node in enumerate(nodes):
        for d in set(node.deps):
            users[by_id[d]].append(pos)
            indegree[pos] += 1
    ready = [pos for pos, deg in enumerate(indegree) if deg == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        pos = heapq.heappop(ready)
        order.append(pos)
        for u in users[pos]:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(nodes):
        stuck = [nodes[pos] for pos, deg in enumerate(indegree) if deg > 0]
        names = ", ".join(f"{n.id} ({n.name})" for n in stuck[:4])
        raise PoetError(f"the graph has a cycle through nodes {names}", source=source, field="links")
    return order
