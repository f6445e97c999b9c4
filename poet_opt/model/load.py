"""One function from "where the network comes from" to a training graph, for the CLI and notebooks:
a zoo model, a node-link JSON file, a PyTorch module or an ONNX file, then partial fine-tuning,
the optimizer step and measured per-layer costs on top."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from poet_opt.errors import PoetError
from poet_opt.model.graph import TrainingGraph


def load_training_graph(model: str | None = None, graph_file: str | None = None, torch: str | None = None,
                        onnx: str | None = None, *, batch_size: int = 1, bytes_per_element: int = 4,
                        input_shape=None, trainable="all", costs=None, optimizer: str = "none",
                        weights: str = "resident", device_ram_bytes: int | None = None,
                        stack_reserve_bytes: int = 0, tile_bytes: int | None = None,
                        ram_bytes: int | None = None, strips="auto",
                        before_tiling: Callable[[TrainingGraph], None] | None = None) -> tuple[TrainingGraph, str]:
    """Exactly one of ``model`` (zoo name), ``graph_file`` (node-link JSON), ``torch`` (FILE.py:FACTORY or
    package.module:FACTORY) or ``onnx`` (FILE.onnx). ``input_shape``: for zoo models without the batch
    (``3x32x32``); for torch and ONNX the whole tensor, batch first (``1,3,32,32``). ``costs``: a CSV/YAML
    file or a :class:`~poet_opt.model.measured_costs.MeasuredCosts`. ``weights``: "resident" (held in RAM
    all step, outside the plan) or "streamed" (in the plan, read from storage when needed and updated
    in place: docs/streaming.md) or "auto": streamed when resident weights, their gradients, optimizer
    state, ``stack_reserve_bytes`` and the working memory a plan may use (``ram_bytes``, the largest
    budget asked, or plain training's peak if less; at least the smallest working set) exceed ``device_ram_bytes`` and
    streaming brings them within it (else resident, with what streaming would need in
    ``meta["streamed_working_set"]`` for the message). ``tile_bytes``: with streamed weights, split
    layers with more weights than that into slices (model/tiling.py). ``strips`` (zoo models and torch
    modules, streamed weights; model/strips.py, and for transformers row blocks of tokens, model/rows.py
    and model/torch_rows.py): "auto" splits activations into strips along H only when some node's
    working set and ``stack_reserve_bytes`` exceed ``device_ram_bytes`` otherwise, with the fewest
    strips that bring every node within ``ram_bytes`` and the device; "off" never; N: at most N
    strips per tensor. ``before_tiling`` is called with a zoo model's or torch module's streamed graph before
    it is split into strips or rows (seconds for bert-base), to refuse it early. Returns (graph, display name)."""
    given = [(flag, value) for flag, value in (("--model", model), ("--graph", graph_file), ("--torch", torch),
                                                ("--onnx", onnx)) if value]
    if len(given) != 1:
        raise PoetError("give exactly one of --model NAME, --graph FILE, --torch FILE.py:FACTORY or --onnx FILE",
                        field="/".join(flag for flag, _ in given) if given else "--model")
    flag, _ = given[0]
    table = None
    if costs is not None:  # read once: --weights auto may build the graph twice
        from poet_opt.model.measured_costs import MeasuredCosts, load_costs

        table = costs = costs if isinstance(costs, MeasuredCosts) else load_costs(costs)
    strips = strips_value(strips)
    weights = weights_for_strips(strips, weights)
    if strips not in ("auto", "off") and model is None and torch is None:
        raise PoetError("activation strips need a zoo model (--model) or a torch module (--torch) with streamed "
                        "weights (--weights streamed)", field="--strips")
    if weights == "auto":
        try:
            graph, name = load_training_graph(model, graph_file, torch, onnx, batch_size=batch_size,
                                              bytes_per_element=bytes_per_element, input_shape=input_shape,
                                              trainable=trainable, costs=costs, optimizer=optimizer)
        except RowsOnly:  # a transformer no backend runs whole: streamed, in row tiles
            graph = None
        if graph is not None and (graph_file or not needs_streaming(graph, device_ram_bytes, stack_reserve_bytes,
                                                                    ram_bytes)):
            return graph, name
        streamed, name = load_training_graph(model, graph_file, torch, onnx, batch_size=batch_size,
                                          bytes_per_element=bytes_per_element, input_shape=input_shape,
                                          trainable=trainable, costs=costs, optimizer=optimizer, weights="streamed",
                                          tile_bytes=tile_bytes, device_ram_bytes=device_ram_bytes,
                                          stack_reserve_bytes=stack_reserve_bytes, ram_bytes=ram_bytes, strips=strips,
                                          before_tiling=before_tiling)
        working, node = streamed.largest_working_set()
        if graph is None or working + stack_reserve_bytes <= device_ram_bytes:
            return streamed, name
        graph.meta["streamed_working_set"] = {"bytes": working, "node": node.name}
        graph.meta["strips_tried"] = streamed.meta.get("strips_tried", False)
        return graph, name
    if weights not in ("resident", "streamed"):
        raise PoetError(f"unknown weights placement {weights!r}; choose auto, resident or streamed", field="--weights")
    streaming = ({"weights": weights, "optimizer": optimizer or "none", "tile_bytes": tile_bytes}
                 if weights == "streamed" else {})
    known = table.names() if table else frozenset()
    partial = trainable is not None and not (isinstance(trainable, str) and trainable.strip().lower() == "all")
    if flag in ("--torch", "--onnx") and batch_size != 1:
        raise PoetError("the batch is the first number of --input-shape for --torch and --onnx models",
                        field="--batch-size")
    if flag == "--graph":
        if partial:
            raise PoetError("a node-link graph carries no parameters; --trainable applies to --model, --torch "
                            "and --onnx", field="--trainable")
        if input_shape is not None:
            raise PoetError("a node-link graph has fixed sizes; --input-shape applies to the other sources",
                            field="--input-shape")
        if weights == "streamed":
            raise PoetError("a node-link graph carries no layers to stream weights for; --weights streamed "
                            "applies to --model, --torch and --onnx", field="--weights")
        from poet_opt.model.node_link import load_node_link

        graph, name = load_node_link(graph_file), Path(graph_file).stem
    elif flag == "--model":
        from poet_opt.model.zoo import build_model

        def zoo(counts=None, rows=None):
            return build_model(model, batch_size=batch_size, input_shape=input_shape,
                               bytes_per_element=bytes_per_element, trainable=trainable, strips=counts, rows=rows,
                               **streaming)

        graph, name = zoo(), model
        if before_tiling is not None and graph.streams_weights:
            before_tiling(graph)
        if weights == "streamed" and strips != "off":
            graph = _striped(graph, zoo, strips, device_ram_bytes, stack_reserve_bytes, ram_bytes)
    elif flag == "--torch":
        from poet_opt.model.torch_import import import_torch

        if input_shape is None:
            raise PoetError("a PyTorch module needs the input's shape, batch first, e.g. --input-shape 1,3,32,32",
                            field="--input-shape")
        graph = import_torch(torch, input_shape, bytes_per_element=bytes_per_element, trainable=trainable,
                             known_costs=known, **streaming)
        name = torch.rsplit(":", 1)[-1]
        if graph.meta.get("dropout"):  # no backend runs it in any tiling: refused before it is planned
            from poet_opt.model.torch_import import dropout_refusal

            raise dropout_refusal(graph.meta["dropout"])
        whole = None
        if strips in ("auto", "off"):  # N: row tiles anyway
            from poet_opt.model.network import rows_only
            from poet_opt.model.operators import parse_full_shape

            whole = rows_only(torch, parse_full_shape(input_shape), graph, trainable=trainable,
                              streamed=weights == "streamed")
        if whole is not None and (weights != "streamed" or strips == "off"):
            hint, field = ("--weights auto or streamed", "--weights") if weights != "streamed" else \
                ("--strips auto or N", "--strips")
            raise RowsOnly(f"{whole.message}; in row tiles it runs: give {hint}", field=field)
        if before_tiling is not None and graph.streams_weights:
            before_tiling(graph)
        if weights == "streamed" and strips != "off":
            graph = _torch_striped(graph, torch, input_shape, trainable, strips, bytes_per_element, device_ram_bytes,
                                   stack_reserve_bytes, ram_bytes, tile_bytes, rows=whole is not None)
    else:
        from poet_opt.model.onnx_import import import_onnx

        graph = import_onnx(onnx, input_shape=input_shape, bytes_per_element=bytes_per_element,
                            trainable=trainable, known_costs=known, **streaming)
        name = Path(onnx).stem
    if optimizer and optimizer != "none" and weights != "streamed":  # streamed: updates built in
        from poet_opt.model.optimizer import with_optimizer

        graph = with_optimizer(graph, optimizer, bytes_per_element=bytes_per_element)
    if table is not None:
        from poet_opt.model.measured_costs import apply_costs

        graph = apply_costs(graph, table)
    return graph, name


def needs_streaming(graph: TrainingGraph, device_ram_bytes: int | None, stack_reserve_bytes: int,
                    ram_bytes: int | None) -> bool:
    """``--weights auto``'s rule, for every command: stream the weights when the resident weights,
    their gradients, the stack reserve and the working memory a plan may use (``ram_bytes``, or
    plain training's peak if less; at least the smallest working set) exceed the device's RAM."""
    if device_ram_bytes is None:
        return False
    working = graph.min_working_set_bytes()
    if ram_bytes is not None:
        working = max(working, min(ram_bytes, graph.plain_peak_bytes()))
    return graph.param_bytes + graph.param_grad_bytes + stack_reserve_bytes + working > device_ram_bytes


def default_tile_bytes(ram_budgets) -> int | None:
    """The weight-slice size every command uses when ``--weight-tile`` is not given: a quarter of the
    smallest RAM budget, so a slice leaves room for its layer's activations (None: no budget)."""
    budgets = [b for b in (ram_budgets or ()) if b is not None]
    return max(1, min(budgets) // 4) if budgets else None


class RowsOnly(PoetError):
    """A transformer no backend runs whole (model/network.py, rows_only), asked for whole."""


def weights_for_strips(strips, weights: str) -> str:
    """The weights' placement once ``strips`` (strips_value's) is known, the same in every command:
    N strips or row blocks, asked for, stream the weights (auto gives way to them) and cannot be had
    with resident weights."""
    if strips in ("auto", "off"):
        return weights
    if weights == "resident":
        raise PoetError("activation strips and row blocks stream the weights: give --weights auto or streamed, or "
                        "--strips auto", field="--strips")
    return "streamed" if weights == "auto" else weights


def strips_value(strips):
    """--strips as every command takes it: "auto", "off" or a whole number of strips (text or int)."""
    text = str(strips).strip().lower()
    if text in ("auto", "off"):
        return text
    if isinstance(strips, int) and not isinstance(strips, bool) and strips >= 1:
        return strips
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise PoetError(f"expected auto, off or a positive whole number, got {strips!r}", field="--strips")


def _strip_budget(device_ram_bytes, stack_reserve_bytes: int, ram_bytes):
    """What every node of a tiled graph must fit: the RAM budget and the device beside its stack
    reserve, whichever is known and smaller (None: neither)."""
    budget = None if device_ram_bytes is None else device_ram_bytes - stack_reserve_bytes
    return budget if ram_bytes is None else ram_bytes if budget is None else min(budget, ram_bytes)


def _torch_striped(graph: TrainingGraph, spec: str, input_shape, trainable, strips, bytes_per_element: int,
                   device_ram_bytes, stack_reserve_bytes: int, ram_bytes, tile_bytes,
                   rows: bool = False) -> TrainingGraph:
    """A torch CNN's graph with its activations in strips, lowered as `poet-opt emulate` lowers it
    (model/network.py), so that the plan `solve` makes is one the firmware can run: N strips at every
    height, or for "auto" the fewest that bring every node within the RAM budget and the device, and
    only when some node could not fit the device otherwise, with layers over ``tile_bytes`` of weights
    in slices as the zoo's strip graphs have them (``rows``: a transformer no backend runs whole
    goes into row blocks under "auto" whatever its size). A torch transformer's tokens go into row blocks
    the same way, as `poet-opt run` lowers it. Unchanged when neither can help, so that the
    working-set check says what does not fit."""
    from poet_opt.model.torch_rows import tokens_in_rows

    too_big = device_ram_bytes is not None and graph.largest_working_set()[0] + stack_reserve_bytes > device_ram_bytes
    convolutions = any(n.op == "conv2d" for n in graph.nodes)
    transformer = tokens_in_rows(graph.nodes)  # row tiles (model/torch_rows.py)
    if strips == "auto" and not (too_big or rows) or not (convolutions or transformer):
        return graph
    if bytes_per_element != 4:
        raise PoetError(f"activation strips of a torch module are planned in fp32, not {bytes_per_element} bytes "
                        "per element", field="--strips")
    budget = _strip_budget(device_ram_bytes, stack_reserve_bytes, ram_bytes)
    from poet_opt.model.network import lower_network
    from poet_opt.model.operators import parse_full_shape

    striped = lower_network(spec, parse_full_shape(input_shape), trainable=trainable, weights="streamed",
                            strips=strips, strip_budget=budget, tile_bytes=tile_bytes).graph
    if striped is not None and (strips != "auto" or striped.largest_working_set()[0] <= budget):
        return striped  # N strips as asked, as for zoo models: the working-set check says if they fit
    graph.meta["strips_tried"] = True  # for the refusal: strips were tried and did not help
    return graph


def _striped(graph: TrainingGraph, build, strips, device_ram_bytes, stack_reserve_bytes: int, ram_bytes):
    """The graph with its activations in strips (model/strips.py) as ``strips`` asks: N strips at
    every height, or, for "auto" and only when some node cannot fit the device otherwise, the
    fewest that bring every node within the RAM budget and the device (unchanged when none do,
    so that the working-set check says what does not fit)."""
    from poet_opt.model.strips import fit_strips, low_memory

    transformer = any(n.op == "matmul" for n in graph.nodes)
    budget = _strip_budget(device_ram_bytes, stack_reserve_bytes, ram_bytes)
    if strips != "auto" and not transformer:
        return low_memory(build(strips), budget)
    if strips == "auto" and (device_ram_bytes is None or
                             graph.largest_working_set()[0] + stack_reserve_bytes <= device_ram_bytes):
        return graph
    if transformer:  # (seq, d) tensors: row tiling (model/rows.py), N row blocks for --strips N
        if budget is None:
            raise PoetError("row tiling of a transformer needs --ram or a device to fit", field="--strips")
        tiled = build(rows={"budget": budget, **({} if strips == "auto" else {"blocks": strips})})
        if tiled is not None:
            return tiled
        graph.meta["strips_tried"] = True
        return graph
    # Strips split activations, never a weights slice (one output feature at the least): a slice
    # over the budget is refused at once, where doubling the strips rebuilt the graph 17 times (30 s)
    if max((n.bytes for n in graph.nodes if n.op == "param"), default=0) <= budget:
        striped = fit_strips(build, budget)
        if striped.largest_working_set()[0] <= budget:
            return low_memory(striped, budget)
    graph.meta["strips_tried"] = True  # for the refusal: strips were tried and did not help
    return graph
