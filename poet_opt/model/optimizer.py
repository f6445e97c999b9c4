"""The optimizer step as graph nodes: one ``update:LAYER`` node per trained layer, so that the
schedule, its energy and the C plan include the weight update.

An update node reads the layer's weight gradient, which its ``grad:LAYER`` node writes (the zoo's and
the importers' convention), and writes the weights in place: its output lives in parameter memory,
outside the RAM budget, so the node's tensor is 0 bytes. Adam keeps two moments per weight; they are
memory the operator owns for the whole run, like weights, so they are the update node's
``param_bytes`` and show up in the schedule's parameter memory (``memory.optimizer_state_bytes``).
"""

from __future__ import annotations

from poet_opt.errors import PoetError
from poet_opt.model.graph import Node, TrainingGraph

OPTIMIZERS = ("none", "sgd", "adam")
# FLOP per trained weight. SGD: w -= lr * g. Adam: both moments (3 + 4), bias corrections folded into
# the step size, w -= lr * m / (sqrt(v) + eps) (4), as torch.optim.Adam's foreach path computes it.
FLOPS_PER_WEIGHT = {"sgd": 2.0, "adam": 11.0}
STATE_COPIES = {"sgd": 0, "adam": 2}  # plain SGD keeps no state; Adam keeps exp_avg and exp_avg_sq


def optimizer_key(optimizer) -> str:
    """--optimizer as one of OPTIMIZERS, or a one-line error."""
    key = str(optimizer).strip().lower()
    if key not in OPTIMIZERS:
        raise PoetError(f"unknown optimizer {optimizer!r}; choose {', '.join(OPTIMIZERS)}", field="--optimizer")
    return key


def with_optimizer(graph: TrainingGraph, optimizer: str = "none", *, bytes_per_element: int | None = None) \
        -> TrainingGraph:
    """The graph with an update node after each trained layer's gradient (``none``: unchanged)."""
    key = optimizer_key(optimizer)
    if key == "none":
        return graph
    bpe = bytes_per_element or graph.meta.get("bytes_per_element") or 4
    by_name = {n.name: n for n in graph.nodes}
    trained = [n for n in graph.nodes if n.kind == "forward" and n.trainable and n.param_bytes]
    if not trained:
        raise PoetError("the graph has no trained weights to update (a node-link graph carries no parameters); "
                        "--optimizer applies to --model, --torch and --onnx", field="--optimizer")
    nodes = list(graph.nodes)
    next_id = len(nodes)
    state = 0
    for layer in trained:
        grad = by_name.get(f"grad:{layer.name}")
        if grad is None:
            raise PoetError(f"layer {layer.name!r} is trained but the graph has no 'grad:{layer.name}' node",
                            field="--optimizer")
        weights = layer.param_bytes // bpe
        state_bytes = STATE_COPIES[key] * layer.param_bytes
        state += state_bytes
        nodes.append(Node(next_id, f"update:{layer.name}", "backward", 0, (grad.id,),
                          FLOPS_PER_WEIGHT[key] * weights, f"{key}_update", state_bytes, False))
        next_id += 1
    meta = {**graph.meta, "optimizer": key, "optimizer_state_bytes": state}
    return TrainingGraph.build(graph.name, nodes, meta=meta)


def optimizer_state_bytes(graph: TrainingGraph) -> int:
    return sum(n.param_bytes for n in graph.nodes if n.op.endswith("_update"))

