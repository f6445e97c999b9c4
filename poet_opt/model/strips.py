"""Activation strips: the training graph of a CNN whose (C, H, W) tensors are split along H into
strips, so that no node holds a whole large activation or its gradient (docs/streaming.md).

Every node of the result computes one strip (rows [a, b) of its tensor) and reads only the strips
it needs, so the exact maths of the whole network is kept:

- a convolution or pooling strip reads every input strip that overlaps its receptive rows (halo,
  stride and zero padding exact); its data gradient into an input strip gathers the output-gradient
  strips whose windows touch those rows;
- elementwise operators (activations, add, the concat of weight slices) go strip by strip;
- batch norm in training mode normalises with statistics over the whole tensor: a chain of
  ``stats:L@sj`` nodes merges each strip's mean and sum of squared deviations into the previous
  ones (Chan et al.'s pairwise update, stable in floating point), and each strip is normalised
  from the last; its backward needs the sums of dy and dy*xhat over the whole tensor, chained the
  same way in ``gstats:L@sj`` nodes;
- the weight gradient of a layer over strips is a sum: ``wgrad:L@sj`` accumulates it strip by
  strip, and the last one applies the fused, in-place SGD update of the streamed weights. It also
  depends on the last node that back-propagates through L's old weights, and those form a chain, so
  that in every execution order the update comes after the last read of the old weights
  (``TrainingGraph.last_compute_stage``); batch norm's update sits in its last data-gradient node
  for the same reason.

Tensors that are not (C, H, W), such as global pooling and the linear head, stay whole. Strip j of
tensor L is the node ``L@sj`` (``L`` when it has one strip). ``graph.meta["strips"]``, a
:class:`~poet_opt.model.tiling_records.StripTiling`, records per node what it computes (a
``StripRecord``), for the executors, the firmware generator and the tests that replay the graph.
"""

from __future__ import annotations

import math
from typing import Sequence

from poet_opt.errors import PoetError
from poet_opt.model import ops as registry
from poet_opt.model.graph import Node, TrainingGraph
from poet_opt.model.tiling_records import (STRIP_MARK, StripRecord, StripTiling, TiledLayer, partition, receptive,
                                           touching)

# what the operator registry lets go strip by strip (activations, add, the concat of weight slices)
# and what reads a window of rows (convolutions, pooling)
ELEMENTWISE = tuple(n for n in registry.names(split=("elementwise", "channels"), tiling="strips") if n != "input")
WINDOWED = registry.names(split="window", tiling="strips")


def _overlapping(parts: list[tuple[int, int]], rows: tuple[int, int]) -> list[int]:
    return [j for j, (a, b) in enumerate(parts) if a < rows[1] and rows[0] < b]


def _name(base: str, parts, j: int) -> str:
    return base if len(parts) == 1 else f"{base}{STRIP_MARK}{j}"


def _conv_layout(o, ops) -> dict:
    """A convolution's groups and bias, from its parameter count (the zoo records neither): each
    output channel has cin / groups * k * k weights, and one bias when it has one."""
    if o.op != "conv2d" or not o.window:
        return {}
    cin, cout, k2 = ops[o.inputs[0]].shape[0], o.shape[0], o.window[0] ** 2
    for bias in (0, 1):
        per, rest = divmod(o.params - bias * cout, cout * k2)
        if not rest and per and cin % per == 0:
            return {"groups": cin // per, "bias": bool(bias)}
    raise PoetError(f"{o.name}: {o.params} parameters are no convolution's layout", field="--strips")


def strip_counts(ops: Sequence, strips) -> dict[int, int]:
    """{H: strips} from an int (the same count at every height, capped at H) or such a dict."""
    if isinstance(strips, dict):
        return {int(h): int(k) for h, k in strips.items()}
    if isinstance(strips, bool) or not isinstance(strips, int) or strips < 1:
        raise PoetError(f"must be auto, off or a positive whole number, got {strips!r}", field="--strips")
    return {o.shape[1]: min(strips, o.shape[1]) for o in ops if len(o.shape) == 3}


def strip_graph(name: str, ops: Sequence, batch: int, bpe: int, train: set[int], needs_grad: list[bool],
                meta: dict, strips: dict[int, int], *, flops_per_weight: float = 2.0) -> TrainingGraph:
    """The streamed-weights training graph (plain SGD) of ``ops`` (zoo forward operators, weight
    slices already cut) with every (C, H, W) tensor of height H in ``strips.get(H, 1)`` strips."""
    parts: list[list[tuple[int, int]] | None] = []
    for o in ops:
        if len(o.shape) != 3:
            parts.append(None)
            continue
        k = strips.get(o.shape[1], 1)
        if k > 1 and o.op not in ("input", "batchnorm", *ELEMENTWISE) and not (o.op in WINDOWED and o.window):
            raise PoetError(f"{o.name} ({o.op}) cannot be split into strips", field="--strips")
        parts.append(partition(o.shape[1], k))
    for o, pp in zip(ops, parts):  # a striped tensor read whole by a layer with weights: not supported
        if pp is None and o.params and any(parts[j] and len(parts[j]) > 1 for j in o.inputs):
            raise PoetError(f"{o.name} ({o.op}) reads a tensor split into strips whole; use fewer strips",
                            field="--strips")
        # strip j of an elementwise operator reads strip j of each input: their rows must agree
        if pp is not None and not (o.op in WINDOWED and o.window) and \
                any(parts[j] is not None and parts[j] != pp and len(parts[j]) > 1 for j in o.inputs):
            raise PoetError(f"{o.name} ({o.op}) reads a tensor split into strips it cannot follow row for row "
                            f"(shape {tuple(o.shape)}); use --strips off", field="--strips")

    nodes: list[Node] = []
    info: dict[str, StripRecord] = {}
    next_id = [0]
    # a trained layer's forward nodes are trainable, as in the zoo's graph without strips: one network
    # lowered with strips=1 or without them is the same graph (run checks a plan's against its own)
    trained = {ops[i].name for i in train}

    def add(nm: str, kind: str, nbytes: int, deps, flops: float, op: str, record: StripRecord, *, updates=(),
            writes=0, trainable=False) -> int:
        trainable = trainable or (record.role == "forward" and record.layer in trained)
        i = next_id[0]
        next_id[0] += 1
        nodes.append(Node(i, nm, kind, int(nbytes), tuple(sorted(set(deps))), float(flops), op, 0, trainable,
                          updates=tuple(updates), writes_bytes=int(writes)))
        info[nm] = record
        return i

    def strip_bytes(i: int, rows) -> int:
        o = ops[i]
        if rows is None:
            return math.prod(o.shape) * bpe * batch
        return o.shape[0] * (rows[1] - rows[0]) * o.shape[2] * bpe * batch

    def share(i: int, rows) -> float:
        return 1.0 if rows is None else (rows[1] - rows[0]) / ops[i].shape[1]

    def strips_of(i: int):
        return parts[i] if parts[i] is not None else [None]

    fwd: list[list[int]] = []
    param: dict[int, int] = {}
    stats: dict[int, int] = {}  # batch norm over several strips -> its last stats node
    for i, o in enumerate(ops):
        if o.params:
            param[i] = add(f"param:{o.name}", "forward", o.params * bpe, (), 0.0, "param",
                           StripRecord("param", o.name), trainable=i in train)
        extra = (param[i],) if i in param else ()
        ids = []
        pp = parts[i]
        if pp is None:
            deps = [d for j in o.inputs for d in fwd[j]]
            ids.append(add(o.name, "forward", strip_bytes(i, None), (*deps, *extra), o.flops * batch, o.op,
                           StripRecord("forward", o.name)))
        elif o.op == "batchnorm" and len(pp) > 1:
            x = o.inputs[0]
            prev = None
            for j, rows in enumerate(pp):  # 3 of batch norm's 5 FLOP per element: mean and deviations
                prev = add(f"stats:{o.name}{STRIP_MARK}{j}", "forward", 2 * o.shape[0] * bpe,
                           (fwd[x][j], *(() if prev is None else (prev,))), 3 * o.flops / 5 * batch * share(i, rows),
                           "batchnorm_stats", StripRecord("bn_stats", o.name, rows=rows))
            stats[i] = prev
            for j, rows in enumerate(pp):
                ids.append(add(_name(o.name, pp, j), "forward", strip_bytes(i, rows), (fwd[x][j], prev, *extra),
                               2 * o.flops / 5 * batch * share(i, rows), o.op,
                               StripRecord("forward", o.name, rows=rows)))
        else:
            for j, rows in enumerate(pp):
                if o.op == "input":
                    deps = []
                elif o.op in WINDOWED and o.window:
                    (x,) = o.inputs
                    deps = [fwd[x][m] for m in _overlapping(parts[x], receptive(rows, o.window, ops[x].shape[1]))]
                else:
                    deps = [fwd[x][j] for x in o.inputs]
                ids.append(add(_name(o.name, pp, j), "forward", strip_bytes(i, rows), (*deps, *extra),
                               o.flops * batch * share(i, rows), o.op, StripRecord("forward", o.name, rows=rows)))
        fwd.append(ids)
    logits = len(ops) - 1
    if parts[logits] is not None and len(parts[logits]) > 1:
        raise PoetError("the network's output cannot be split into strips", field="--strips")
    loss = add("loss", "loss", bpe * batch, fwd[logits], 5.0 * math.prod(ops[logits].shape) * batch, "loss",
               StripRecord("loss"))

    users: list[list[int]] = [[] for _ in ops]
    for u, o in enumerate(ops):
        for x in dict.fromkeys(o.inputs):
            users[x].append(u)

    def multi(u: int) -> bool:  # backward over several strips: accumulate its weight gradient
        return any(len(strips_of(j)) > 1 for j in (u, *ops[u].inputs))

    grad: dict[int, list[int]] = {}
    alias: dict[str, str] = {}  # weight slice -> the concat whose gradient strips it reads
    gstats: dict[int, int] = {}
    host: dict[tuple[int, int], int] = {}  # (weighted layer u, strip j of its input) -> node of that term
    last_reader: dict[int, int] = {}  # layer -> its last data-gradient node that reads its weights

    def update_fields(u: int) -> dict:
        return {"updates": (param[u],), "writes": ops[u].params * bpe}

    def term(u: int, f: int, j: int, rows):
        """(deps, flops, reads weights) of the data gradient back through u into strip j of f."""
        o = ops[u]
        deps: set[int] = set()
        if parts[u] is None or (o.op not in WINDOWED or not o.window) and len(strips_of(u)) == 1 \
                and len(strips_of(f)) == 1:
            deps |= set(grad[u])
            for rule in o.saves.split("+"):
                if rule == "in":
                    deps |= {d for x in o.inputs for d in fwd[x]}
                elif rule == "out":
                    deps |= set(fwd[u])
                elif rule == "other":
                    deps |= {d for x in o.inputs if x != f for d in fwd[x]}
            if u in stats:
                deps |= {stats[u]}
            flops = o.flops * batch * (share(f, rows) if parts[u] is None else 1.0)
        elif o.op in WINDOWED and o.window:
            touched = touching(rows, o.window, o.shape[1])
            deps |= {grad[u][m] for m in _overlapping(parts[u], touched)}
            if "in" in o.saves:  # max pooling: the arg max of every touched window
                reads = receptive(touched, o.window, ops[f].shape[1])
                deps |= {fwd[f][m] for m in _overlapping(parts[f], reads)}
            flops = o.flops * batch * share(f, rows)
        elif o.op == "batchnorm":
            deps |= {grad[u][j], fwd[f][j], stats[u], gstats[u]}
            flops = 4 * o.flops / 5 * batch * share(u, rows)
        else:  # elementwise, strip by strip
            deps.add(grad[u][j])
            if "out" in o.saves:
                deps.add(fwd[u][j])
            if "in" in o.saves:
                deps |= {fwd[x][j] for x in o.inputs}
            flops = o.flops * batch * share(u, rows)
        if u in param:
            deps.add(param[u])
        return deps, flops, u in param

    def needs_own(u: int) -> bool:
        """Whether u's update runs in nodes of its own: a weight gradient summed over strips, or no
        input gradient to fuse it into (batch norm over strips updates in its last data gradient)."""
        has_input_grad = any(needs_grad[x] for x in ops[u].inputs)
        return (multi(u) and ops[u].op != "batchnorm") or not has_input_grad

    acc_of: dict[int, object] = {}  # layer -> (next link, last accumulator) or "done"

    def emit_wgrad(u: int, upto_last: bool) -> None:
        """Links of u's weight-gradient chain over its output strips: all but the last as soon as
        u's gradient exists; the last, which applies the update, once the last reader of u's old
        weights exists too (``upto_last``)."""
        o = ops[u]
        state = acc_of.get(u, (0, None))
        if state == "done":
            return
        if o.op == "batchnorm":  # only when its input needs no gradient (else: in its last data gradient)
            if len(strips_of(u)) > 1:
                raise PoetError(f"{o.name}: batch norm over strips right after the input is not supported",
                                field="--strips")
            add(f"update:{o.name}", "backward", 0, {grad[u][0], *fwd[o.inputs[0]], param[u]},
                o.flops * batch + flops_per_weight * o.params, "sgd_update", StripRecord("update", o.name),
                **update_fields(u))
            acc_of[u] = "done"
            return
        (x,) = o.inputs
        rows_all = strips_of(u)
        m0, acc = state
        after = {last_reader[u]} if u in last_reader else set()
        for m in range(m0, len(rows_all) if upto_last else len(rows_all) - 1):
            rows = rows_all[m]
            reads = receptive(rows, o.window, ops[x].shape[1]) if rows is not None and o.window else None
            deps = {grad[u][m], *(fwd[x][q] for q in (_overlapping(parts[x], reads) if reads else
                                                      range(len(fwd[x]))))}
            last = m == len(rows_all) - 1
            if acc is not None:
                deps.add(acc)
            fields = {}
            if last:
                deps |= {param[u], *after}
                fields = update_fields(u)
            nm = f"wgrad:{_name(o.name, rows_all, m)}" if len(rows_all) > 1 or after else f"update:{o.name}"
            acc = add(nm, "backward", 0 if last else o.params * bpe, deps,
                      o.flops * batch * share(u, rows) + (flops_per_weight * o.params if last else 0),
                      "sgd_update" if last else f"{o.op}_wgrad",
                      StripRecord("wgrad", o.name, prev=None if acc is None else nodes[acc].name, update=last,
                                  rows=rows), **fields)
        acc_of[u] = "done" if upto_last else (len(rows_all) - 1, acc)

    for f in reversed(range(len(ops))):
        if not needs_grad[f]:
            continue
        o_f = ops[f]
        # batch norm over strips: the whole-tensor sums of dy and dy*xhat its data gradient needs
        for u in users[f]:
            if u in stats and u not in gstats and len(strips_of(u)) > 1:
                prev = None
                for j, rows in enumerate(parts[u]):
                    prev = add(f"gstats:{ops[u].name}{STRIP_MARK}{j}", "backward", 2 * ops[u].shape[0] * bpe,
                               (grad[u][j], fwd[f][j], stats[u], *(() if prev is None else (prev,))),
                               ops[u].flops / 5 * batch * share(u, rows), "batchnorm_grad_stats",
                               StripRecord("bn_gstats", ops[u].name, rows=rows))
                gstats[u] = prev
        ids = []
        only = users[f][0] if len(users[f]) == 1 else None
        if only is not None and ops[only].op == "concat" and len(strips_of(f)) > 1:
            # a weight slice over strips reads its channels of the concat's gradient strips: a copy
            # per slice and strip would be one more tensor to hold or page for every pair
            ids = grad[only]
            alias[o_f.name] = ops[only].name
        for j, rows in enumerate(strips_of(f) if not ids else ()):
            terms = [(u, *term(u, f, j, rows)) for u in users[f]]
            weighted = [t for t in terms if t[3]]
            plain = [t for t in terms if not t[3]]
            groups = [[t] for t in weighted[:-1]] + [weighted[-1:] + plain]
            prev = None
            base = f"grad:{_name(o_f.name, strips_of(f), j)}"
            for n, group in enumerate(groups):
                final = n == len(groups) - 1
                deps: set[int] = {prev} if prev is not None else set()
                flops = 0.0
                if final and f == logits:  # softmax minus target
                    deps |= {loss, *fwd[logits]}
                    flops += 2.0 * math.prod(o_f.shape) * batch
                hosted: list[int] = []
                for u, tdeps, tflops, _ in group:
                    deps |= tdeps
                    flops += tflops
                    if u in param and (u, j - 1) in host:  # the readers of u's weights form a chain
                        deps.add(host[(u, j - 1)])
                    if u in train and u in param and not multi(u) and len(ops[u].inputs) == 1:
                        hosted.append(u)  # one strip: the update fused into its data gradient, as unstriped
                    elif u in train and u in param and ops[u].op == "batchnorm" and j == len(parts[u]) - 1:
                        hosted.append(u)  # the last reader of gamma; gstats holds the sums
                for u in hosted:  # dW reads u's inputs and output gradient; gstats already holds BN's sums
                    if u not in gstats:
                        deps |= {d for x in ops[u].inputs for d in fwd[x]} | {grad[u][-1]}
                    flops += (0 if u in gstats else ops[u].flops * batch) + flops_per_weight * ops[u].params
                # partial sums: grad:x@n as unstriped graphs name them, grad:x@sj+n for a strip
                nm = base if final else f"{base}{'+' if len(strips_of(f)) > 1 else '@'}{n}"
                op = f"{o_f.op}_grad" if final else f"{o_f.op}_grad_part"
                record = StripRecord("grad", of=o_f.name, rows=rows, terms=tuple(ops[u].name for u, *_ in group),
                                     prev=None if prev is None else nodes[prev].name,
                                     updates=tuple(ops[u].name for u in hosted), logits=final and f == logits)
                prev = add(nm, "backward", strip_bytes(f, rows), deps, flops, op, record,
                           updates=tuple(param[u] for u in hosted),
                           writes=sum(ops[u].params * bpe for u in hosted))
                for u, *_ in group:
                    if u in param:
                        host[(u, j)] = prev
                        last_reader[u] = prev
            ids.append(prev)
        grad[f] = ids
        for u in sorted({f, *users[f]}):
            if u in train and u in param and needs_own(u):
                emit_wgrad(u, upto_last=u != f or not any(needs_grad[x] for x in ops[u].inputs))
    layers = {o.name: TiledLayer(o.name, o.op, tuple(o.shape), tuple(ops[x].name for x in o.inputs), o.params,
                                 tuple(o.window), **_conv_layout(o, ops)) for o in ops}
    meta = {**meta, "strips": StripTiling(
        layers, info, grad_alias=alias, per_height={str(h): k for h, k in sorted(strips.items()) if k > 1},
        tensors={o.name: pp for o, pp in zip(ops, parts) if pp and len(pp) > 1})}
    return TrainingGraph.build(name, nodes, meta=meta)



def fit_strips(build, budget_bytes: int, max_rounds: int = 32) -> TrainingGraph:
    """The graph ``build(strips)`` (strips: {H: count}) with the fewest strips found, by doubling the
    count of every height the largest working set touches until it fits ``budget_bytes``; the last
    graph tried when no more strips help (the caller's working-set check then refuses it)."""
    counts: dict[int, int] = {}
    graph = build(counts)
    if graph.largest_working_set()[0] <= budget_bytes:
        return graph
    # One build with every height in one-row strips first: when even that does not fit (a weights
    # slice or a whole tensor too large), no search can, and doubling up to it took 15 builds (20 s).
    layers = [info for info in graph.meta["strips"].layers.values() if len(info.shape) == 3]
    # only heights whose every tensor strip_graph can split (an attention's (heads, seq, seq) scores cannot)
    splittable = {info.shape[1] for info in layers} - {
        info.shape[1] for info in layers
        if info.op not in ("input", "batchnorm", *ELEMENTWISE) and not (info.op in WINDOWED and info.window)}
    if splittable:
        finest = build({h: h for h in splittable})
        if finest.largest_working_set()[0] > budget_bytes:
            return finest
    for _ in range(max_rounds):
        working, node = graph.largest_working_set()
        if working <= budget_bytes:
            break
        layers = graph.meta["strips"].layers
        records = graph.meta["strips"].nodes
        heights = set()
        for n in (node, *(graph.nodes[d] for d in node.deps)):
            layer = records[n.name].tensor
            shape = layers[layer].shape if layer in layers else ()
            if len(shape) == 3 and counts.get(shape[1], 1) < shape[1]:
                heights.add(shape[1])
        if not heights:
            break
        counts = {**counts, **{h: min(h, 2 * counts.get(h, 1)) for h in heights}}
        graph = build(counts)
    return graph


STRIP_OPS = ("batchnorm_stats", "batchnorm_grad_stats", "conv2d_wgrad")


def first_node_of(nodes, ops, name_pattern: str) -> str | None:
    """The first node of a graph or schedule document (dicts with name and op) whose op is one of
    ``ops`` or whose name matches ``name_pattern``, or None: how executors without the kernels of a
    tiling recognise its plans."""
    import re

    for n in nodes:
        name, op = (n["name"], n.get("op", "")) if isinstance(n, dict) else (n.name, n.op)
        if op in ops or re.search(name_pattern, name):
            return name
    return None


def strip_node(nodes) -> str | None:
    """The first node that belongs to activation strips, or None."""
    return first_node_of(nodes, STRIP_OPS, rf"{STRIP_MARK}\d+(\+\d+)?$")


def refuse_strips(nodes, who: str, field: str) -> None:
    """Executors without strip kernels refuse a strip plan rather than run it wrongly."""
    name = strip_node(nodes)
    if name is not None:
        raise PoetError(f"the plan splits activations into strips (node {name}); {who} does not run activation "
                        "strips yet", field=field)


def refuse_needing_strips(graph: TrainingGraph, device_ram_bytes: int, stack_bytes: int, who: str,
                          device: str) -> None:
    """A model that only fits the device with its activations in strips (poet-opt solve plans it)
    is refused by executors that do not run strips, in one line, before any solve."""
    from poet_opt.units import format_bytes

    working, node = graph.largest_working_set()
    if working + stack_bytes > device_ram_bytes and any(n.bytes and n.op == "conv2d" for n in graph.nodes):
        raise PoetError(f"computing {node.name} holds {format_bytes(working)} at once, more than {device}'s "
                        f"{format_bytes(device_ram_bytes)} of RAM with the stack: it needs its activations split "
                        f"into strips (poet-opt solve plans them), which {who} does not run yet", field="--ram")


def low_memory(graph: TrainingGraph, budget_bytes: int | None = None) -> TrainingGraph:
    """The strip graph in the greedy low-memory execution order (model/orders.py): the builder
    emits it layer by layer, which holds every strip of a layer's gradient at once; the greedy
    order walks strip by strip, so that the starting plans page far fewer tensors. (Plain
    training's peak, the weights, is the same in both, so ``--order auto`` would not try it.)
    Given the RAM budget, layers with weight slices then use each slice for a block of strips at
    a time instead of reading it again for every strip (model/strip_order.py)."""
    from poet_opt.model.orders import low_memory_order
    from poet_opt.model.strip_order import slice_block_order

    strips = graph.meta.get("strips")
    if strips is None or not strips.tensors:
        return graph
    order = low_memory_order(graph)
    if budget_bytes is not None and graph.meta.get("tiles"):
        order = slice_block_order(graph, budget_bytes, base=order)
    return graph if order is None else graph.reordered(order)
