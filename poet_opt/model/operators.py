"""What the PyTorch and ONNX importers share: the operator vocabulary with its FLOP counts and
backward rules, and the step from a list of forward operators to a training graph.

Both importers lower a network to the model zoo's forward operators (:class:`poet_opt.model.zoo.ForwardOp`,
whole tensors with the batch inside, so the batch passed on is 1) and hand them to the zoo's own
backward derivation. The same network therefore gives the same graph whether it comes from the zoo,
from a ``torch.nn.Module`` or from an ONNX file.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Iterable, Sequence

from poet_opt.errors import PoetError
from poet_opt.model.graph import TrainingGraph
from poet_opt.model.zoo import ForwardOp, training_graph

# What an operator costs per element and what its backward reads lives in the operator registry
# (poet_opt.model.ops); the rule below needs more than the output's size.


def attention_flops(batch_heads: int, seq_q: int, seq_k: int, d_qk: int, d_v: int) -> float:
    # scores = Q K^T, softmax, context = P V: the zoo counts the same three steps as separate nodes
    return 2.0 * batch_heads * seq_q * seq_k * (d_qk + d_v) + 5.0 * batch_heads * seq_q * seq_k


class OpList:
    """Collects forward operators in execution order; op 0 is the network's input."""

    def __init__(self, input_shape: Sequence[int], input_name: str = "input"):
        self.ops: list[ForwardOp] = [ForwardOp(input_name, "input", tuple(input_shape), (), 0.0)]
        self._names = {input_name}
        # op name -> what the importer lowered it from (a torch.fx node): the firmware generator
        # reads each operator's attributes and parameters there
        self.origins: dict[str, object] = {}

    def add(self, name: str, op: str, inputs: Iterable[int], shape: Sequence[int], flops: float,
            params: int = 0, saves: str = "") -> int:
        self.ops.append(ForwardOp(self.unique(name), op, tuple(int(d) for d in shape), tuple(dict.fromkeys(inputs)),
                                  float(flops), int(params), saves))
        return len(self.ops) - 1

    def unique(self, name: str) -> str:
        """Functional ops can share a scope (two adds in one block): number the later ones."""
        name = name or "op"
        candidate, k = name, 1
        while candidate in self._names:
            candidate, k = f"{name}_{k}", k + 1
        self._names.add(candidate)
        return candidate


def finish(name: str, ops: list[ForwardOp], output: int, *, bytes_per_element: int, trainable, meta: dict,
           field: str, weights: str = "resident", optimizer: str = "none", tile_bytes: int | None = None) \
        -> TrainingGraph:
    """Drop what does not lead to the output (shape bookkeeping, unused branches), put the output
    last, and derive loss and backward graph with the zoo's rules."""
    if output == 0:
        raise PoetError("the model returns its input unchanged: there is nothing to train", field=field)
    needed = {output}
    for i in range(output, -1, -1):
        if i in needed:
            needed.update(ops[i].inputs)
    if 0 not in needed:
        raise PoetError("the model's output does not depend on its input", field=field)
    keep = sorted(needed)  # the output is every kept op's descendant, so it sorts last
    new_index = {old: k for k, old in enumerate(keep)}
    kept = [ForwardOp(o.name, o.op, o.shape, tuple(new_index[j] for j in o.inputs), o.flops, o.params, o.saves)
            for o in (ops[i] for i in keep)]
    if not isinstance(bytes_per_element, int) or isinstance(bytes_per_element, bool) or bytes_per_element < 1:
        raise PoetError(f"must be a positive whole number, got {bytes_per_element!r}", field="--bytes-per-element")
    meta = {**meta, "bytes_per_element": bytes_per_element, "forward_layers": len(kept) - 1}
    graph = training_graph(name, kept, 1, bytes_per_element, trainable, meta, weights=weights, optimizer=optimizer,
                           tile_bytes=tile_bytes)
    # the shapes hold the batch, so the zoo's rule was told batch 1; the loss keeps one value per
    # sample, as the zoo sizes it
    batch = kept[0].shape[0] if kept[0].shape else 1
    nodes = tuple(replace(n, bytes=bytes_per_element * batch) if n.kind == "loss" else n for n in graph.nodes)
    return TrainingGraph(graph.name, nodes, graph.meta)


def parse_full_shape(value, field: str = "--input-shape") -> tuple[int, ...]:
    """'1,3,32,32', '1x3x32x32' or a sequence: the whole input tensor, batch first."""
    if isinstance(value, str):
        parts = [p for p in re.split(r"[x,\s()\[\]]+", value.strip().lower()) if p]
    elif isinstance(value, int) and not isinstance(value, bool):
        parts = [value]
    else:
        parts = list(value) if value is not None else []
    try:
        shape = tuple(int(p) if isinstance(p, str) else _whole(p) for p in parts)
    except (TypeError, ValueError):
        shape = ()
    if not shape or min(shape) < 1:
        raise PoetError(f"expected the whole input shape, batch first, in positive whole numbers "
                        f"(e.g. 1,3,32,32), got {value!r}", field=field)
    return shape


def _whole(p) -> int:
    if isinstance(p, bool) or not float(p).is_integer():
        raise TypeError(p)
    return int(p)


def unsupported(op: str, node: str, known_costs: frozenset, field: str) -> None:
    """An operator without a FLOP rule is accepted only when the measured-cost file times it."""
    if op in known_costs or node in known_costs:
        return
    raise PoetError(f"operator {op!r} (node {node!r}) has no FLOP rule in poet-opt; give its measured time in a "
                    f"--costs file, a row named {node!r} or {op!r} (back-propagating through it is part of its "
                    "input's gradient node, grad:INPUT, which can have a row too; docs/importers.md)", field=field)


def elements(shape: Sequence[int]) -> int:
    return math.prod(shape)
