"""The network as executed (firmware, PyTorch executor): each forward operator of the training graph with what its
kernel needs (geometry, operand order, parameters with their PyTorch names and initial values).

The training graph knows sizes and dependencies only. The generated C needs more: a convolution's
stride and padding, which operand of a product comes first, the weights to start from. This module
reads them from the same torch.fx trace the importer lowered the graph from, so every graph node
has exactly one layer here, under the same name. What no kernel executes exactly as PyTorch would
(a transposing view, dropout, a dilated convolution, ...) is an error naming the node, never an
approximation.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.model import ops as registry
from poet_opt.model.graph import TrainingGraph
from poet_opt.model.operators import finish
from poet_opt.model.tiling import feature_ranges
from poet_opt.model.tiling_records import WeightSlices
from poet_opt.model.torch_import import dropout_node, dropout_refusal, lower_module, resolve_module
from poet_opt.model.torch_rows import is_row_model, row_training_graph, token_vocabulary, tokens_in_rows

FIELD = "--torch"  # the layers come from a torch module, as that option names it

# Views that leave a contiguous tensor's bytes where they are: the consumer reads the producer's
# buffer as it is. Any other view (a transpose, a slice) would need a kernel of its own.
_FLAT_VIEWS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous", "detach",
               "view_as", "reshape_as", "float", "to", "type_as"}
_ADD = {"add", "iadd", "radd"}
# Views that move elements (lower_network(views=True) only: the executor replays them, a C kernel could not)
_MOVING_VIEWS = {"transpose", "permute", "t", "movedim", "swapaxes", "expand", "expand_as", "view", "reshape"}


@dataclass
class Parameter:
    torch_name: str  # as named_parameters() (or named_buffers()) calls it
    value: np.ndarray  # float32, PyTorch's shape (a tile's: its rows of it)
    # a tiled layer's slice: rows lo..hi of the torch parameter, whose whole shape is full_shape
    rows: tuple[int, int] | None = None
    full_shape: tuple[int, ...] | None = None
    # a row tile's block of a weight matrix: its columns lo..hi as well (the input features it reads)
    cols: tuple[int, int] | None = None

    def where(self) -> str:
        """The part of the torch parameter this one is, as a slice ("" for the whole)."""
        if self.rows is None:
            return ""
        cols = "" if self.cols is None else f", {self.cols[0]}:{self.cols[1]}"
        return f"[{self.rows[0]}:{self.rows[1]}{cols}]"

    def index(self) -> tuple:
        return (slice(*self.rows),) if self.cols is None else (slice(*self.rows), slice(*self.cols))


@dataclass
class Layer:
    name: str
    op: str  # input, conv2d, batchnorm, relu, relu6, gelu, maxpool, avgpool, linear, add, matmul, softmax,
    #          layernorm, copy
    shape: tuple[int, ...]  # output, batch first
    operands: list[str]  # producers of the kernel's tensor operands, in argument order (repeats kept)
    operand_shapes: list[tuple[int, ...]]
    attrs: dict = field(default_factory=dict)
    params: dict[str, Parameter] = field(default_factory=dict)  # weight, bias (gamma, beta for norms)
    buffers: dict[str, Parameter] = field(default_factory=dict)  # running_mean, running_var
    trainable: bool = False
    # lower_network(views=True), for the PyTorch executor: the fx node the layer runs, and per operand the
    # views (transpose, head split, ...) between its producer and this layer, in the order they apply
    origin: object = None
    operand_views: list = field(default_factory=list)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass
class Network:
    name: str
    module: object  # the torch.nn.Module, untouched: the reference the firmware is checked against
    input_shape: tuple[int, ...]
    layers: dict[str, Layer]  # by graph node name, in forward order
    graph: TrainingGraph
    output: str  # the layer whose output is the logits
    # the input is token ids into embeddings: the rows of the smallest table that reads them (x must
    # hold integers in [0, vocabulary)); None: the input is features (float32)
    vocabulary: int | None = None

    @property
    def trainable_parameters(self) -> list[Parameter]:
        """Per layer, so a tiled layer's parameter appears once per tile, as its rows."""
        return [p for layer in self.layers.values() if layer.trainable for p in layer.params.values()]

    def assemble(self, values: dict[str, list[tuple[Parameter, np.ndarray]]]) -> dict[str, np.ndarray]:
        """torch name -> whole value, from (parameter, value) pairs of whole parameters or of tiles'
        rows (or blocks of rows and columns)."""
        out: dict[str, np.ndarray] = {}
        for name, parts in values.items():
            first = parts[0][0]
            if first.rows is None:
                out[name] = parts[0][1].reshape(first.value.shape).copy()
                continue
            # a row network's layers keep each parameter whole, as it started: a tile no node holds
            # (a position table's rows past the sequence) is never read nor changed
            start = next((q.value for layer in self.layers.values() for q in layer.params.values()
                          if q.torch_name == name and q.rows is None), None)
            whole = np.zeros(first.full_shape, np.float32) if start is None else start.astype(np.float32).copy()
            covered = 0
            for p, v in parts:
                whole[p.index()] = v.reshape(p.value.shape)
                covered += p.value.size
            if covered != whole.size and start is None:
                raise PoetError(f"internal: the tiles of {name!r} cover {covered} of its {whole.size} elements")
            out[name] = whole
        return out


def lower_network(model, input_shape, *, trainable="all", name: str | None = None, views: bool = False,
                  weights: str = "resident", tile_bytes: int | None = None, strips=None,
                  strip_budget: int | None = None) -> Network:
    """The training graph of a torch module (or factory, or ``FILE.py:FACTORY``) and the layer of
    each of its forward nodes. ``views``: accept views that move elements and fused attention, which
    the PyTorch executor replays (``Layer.operand_views``) and the firmware generator cannot.
    ``weights``: "resident" (in RAM for the whole step) or "streamed" (``param:f`` nodes read from
    storage, each layer updated by SGD as soon as its gradient is complete; poet_opt.model.zoo).
    ``tile_bytes`` (streamed only): a convolution or linear layer with more weights than that is
    split into tiles over its output features (model/tiling.py): a layer ``L#j`` per tile, a
    convolution or linear layer with fewer output features whose parameters are the torch
    parameters' rows lo..hi, and a ``concat`` layer ``L`` that joins their outputs. ``strips``
    (streamed only): split the (C, H, W) activations along H (model/strips.py), N strips at every
    height, a dict {H: N}, or "auto": the fewest that bring every node within ``strip_budget``; of a
    transformer (attention, no convolution), its (tokens, features) tensors into N blocks of tokens
    (model/torch_rows.py, model/rows.py), "auto" the tiling with the fewest nodes that fits (the
    graph is None when none does); row tiles cut the weights themselves and ignore ``tile_bytes``."""
    if tile_bytes is not None and weights != "streamed":
        raise PoetError("weight tiles need streamed weights (--weights streamed)", field="--weight-tile")
    if tile_bytes is not None and views:
        raise PoetError("the PyTorch executor replays whole layers; it cannot run weight tiles", field="--weight-tile")
    if strips is not None and (weights != "streamed" or views):
        raise PoetError("activation strips need streamed weights", field="--strips")
    module, default_name = resolve_module(model)
    ops, output = lower_module(module, input_shape)
    meta = {"source": model if isinstance(model, str) else default_name, "format": "torch.fx",
            "input_shape": list(ops.ops[0].shape), "batch_size": ops.ops[0].shape[0]}
    if strips is not None and is_row_model(ops):
        return _row_network(name or default_name, module, ops, output, trainable, meta, strips, strip_budget)
    if strips is not None:
        graph = _strip_graph(name or default_name, ops, output, module, trainable, meta, strips, strip_budget,
                             tile_bytes)
        kept = set(graph.meta["strips"].layers)
    else:
        graph = finish(name or default_name, ops.ops, output, bytes_per_element=4, trainable=trainable, meta=meta,
                       field=FIELD, weights=weights, tile_bytes=tile_bytes)
        kept = {n.name for n in graph.nodes if n.kind == "forward"}
    tiles = graph.meta.get("tiles") or {}
    producers = {ops.origins[o.name]: o.name for o in ops.ops if o.name in ops.origins}
    placeholder = next(n for n in _fx_nodes(ops) if n.op == "placeholder")
    producers[placeholder] = ops.ops[0].name
    shapes = {o.name: tuple(int(d) for d in o.shape) for o in ops.ops}
    modules = dict(module.named_modules())
    param_names = {id(p): n for n, p in module.named_parameters()}
    buffer_names = {id(b): n for n, b in module.named_buffers()}
    trainable_nodes = {n.name[len("param:"):] for n in graph.nodes if n.trainable and n.op == "param"} | \
        {n.name for n in graph.nodes if n.trainable}
    layers: dict[str, Layer] = {}
    used_params: dict[int, str] = {}
    for o in ops.ops:
        if o.name not in kept:
            continue
        if o.op == "input":
            layers[o.name] = Layer(o.name, "input", shapes[o.name], [], [])
            continue
        n = ops.origins[o.name]
        chains: list | None = [] if views else None
        layer = _layer(n, o, shapes, producers, modules, chains)
        layer.origin, layer.operand_views = n, chains or [[] for _ in layer.operands]
        for p in _module_params(n, modules):
            if id(p) in used_params:
                raise PoetError(f"node {o.name!r} shares a parameter with {used_params[id(p)]!r}; the firmware "
                                "generator keeps one copy per layer (untie the weights)", field=FIELD)
            used_params[id(p)] = o.name
        layer.params = {role: Parameter(param_names[id(t)], _array(t)) for role, t in _roles(n, modules).items()
                        if t is not None and id(t) in param_names}
        layer.buffers = {role: Parameter(buffer_names[id(t)], _array(t)) for role, t in _roles(n, modules).items()
                         if t is not None and id(t) in buffer_names}
        layer.trainable = o.name in trainable_nodes
        if o.name in tiles:
            layers.update(_tiled(layer, tiles[o.name], trainable_nodes))
            continue
        layers[o.name] = layer
    out_name = ops.ops[output].name
    return Network(graph.name, module, tuple(shapes[ops.ops[0].name]), layers, graph, out_name,
                   token_vocabulary(module, ops))


def rows_only(model, input_shape, graph: TrainingGraph, *, trainable="all",
              streamed: bool = False) -> PoetError | None:
    """Why no backend runs a transformer whole, when none does. Resident, the PyTorch executor's
    lowering, which takes every view the firmware's takes and more, refuses it (a position table
    read through ``torch.arange``, say); ``streamed``, the firmware's does, since the executor
    streams a transformer's weights only in row tiles. Row tiles see through such views, so every
    command then tiles its tokens under --strips auto (model/load.py, executor/train.py,
    firmware/lowering.py). None for a module that runs whole, or whose ``graph`` (its import) is no
    transformer."""
    if not tokens_in_rows(graph.nodes):
        return None
    if graph.meta.get("dropout"):  # recorded by the import: row tiles cannot run it either
        raise dropout_refusal(graph.meta["dropout"])
    try:
        lower_network(model, input_shape, trainable=trainable, views=not streamed,
                      weights="streamed" if streamed else "resident")
    except PoetError as exc:
        what = "no backend runs it whole" + (" with streamed weights" if streamed else "")
        return PoetError(exc.message.replace(NO_KERNEL, what), field=exc.field)
    return None


def refuse_dropout(module, ops) -> None:
    """No backend reproduces dropout's random mask (a recompute would draw another). The whole
    lowerings refuse it where they meet it; the trace drops it as a view, so a row tiling, built
    from the trace, would train without it: refused here for every tiling."""
    dropped = dropout_node(module, ops)
    if dropped is not None:
        raise dropout_refusal(dropped)


def _row_network(name: str, module, ops, output: int, trainable, meta: dict, strips, budget) -> Network:
    """A transformer in row tiles: one layer per row operator (executor/rows.py replays it), each
    linear's and norm's weight and bias whole; the tiles are the graph's ``param:L#j.k`` nodes."""
    refuse_dropout(module, ops)
    graph, kept = row_training_graph(name, module, ops, output, trainable, meta, strips, budget)
    batch = ops.ops[0].shape[0]
    modules = dict(module.named_modules())
    names = {id(p): n for n, p in module.named_parameters()}
    trained = {n.name[len("param:"):].split("#")[0] for n in graph.nodes if n.op == "param" and n.trainable} \
        if graph is not None else set()
    layers: dict[str, Layer] = {}
    for o in kept:
        operands = [kept[x].name for x in o.inputs]
        layer = Layer(o.name, o.op, (batch, *o.shape), operands, [layers[p].shape for p in operands])
        origin = ops.origins.get(o.name)
        if o.op in ("linear", "layernorm"):
            m = modules[origin.target]
            layer.params = {role: Parameter(names[id(t)], _array(t)) for role, t in (("weight", m.weight),
                                                                                    ("bias", m.bias))}
            layer.trainable = o.name in trained
            if o.op == "layernorm":  # the firmware normalises with the module's own (torch_rows checks it)
                layer.attrs["eps"] = float(m.eps)
        elif o.op == "embedding":  # its table, cut into (vocabulary rows x feature piece) tiles by the graph
            m = modules[origin.target]
            layer.params = {"weight": Parameter(names[id(m.weight)], _array(m.weight))}
            layer.trainable = o.name in trained
        layers[o.name] = layer
    return Network(name, module, tuple(ops.ops[0].shape), layers, graph, kept[-1].name, token_vocabulary(module, ops))


def _strip_graph(name: str, ops, output: int, module, trainable, meta: dict, strips, budget, tile_bytes):
    """The strip graph (model/strips.py) of the traced operators: the zoo's per-sample shapes (the
    batch apart, global pooling to (C,)) and each convolution's and pooling's window along H, which
    the importer does not record."""
    from dataclasses import replace

    from poet_opt.model.strips import fit_strips, low_memory
    from poet_opt.model.zoo import training_graph

    needed = {output}
    for i in range(output, -1, -1):
        if i in needed:
            needed.update(ops.ops[i].inputs)
    keep = sorted(needed)
    index = {old: k for k, old in enumerate(keep)}
    batch = ops.ops[0].shape[0]
    modules = dict(module.named_modules())
    kept = []
    for old in keep:
        o = ops.ops[old]
        origin = ops.origins.get(o.name)
        m = modules.get(origin.target) if origin is not None and origin.op == "call_module" else None
        shape, window = tuple(o.shape[1:]), ()
        global_pool = o.op == "avgpool" and not hasattr(m, "kernel_size") and len(ops.ops[o.inputs[0]].shape) == 4
        if len(o.shape) == 4 and o.shape[2:] == (1, 1) and global_pool:
            shape = shape[:1]  # global average pooling (module, function or mean), as the zoo shapes it
        elif hasattr(m, "kernel_size") and len(o.shape) == 4:
            k, s, p = (_pair(v) for v in (m.kernel_size, m.stride or m.kernel_size, m.padding))
            if k[0] != k[1] or s[0] != s[1] or p[0] != p[1]:
                raise PoetError(f"node {o.name!r}: strips need a square window, stride and padding", field="--strips")
            window = (k[0], s[0], p[0])
        kept.append(replace(o, shape=shape, inputs=tuple(index[j] for j in o.inputs), flops=o.flops / batch,
                            window=window))
    meta = {**meta, "bytes_per_element": 4, "forward_layers": len(kept) - 1}

    def build(counts):
        return training_graph(name, kept, batch, 4, trainable, meta, weights="streamed", strips=counts,
                              tile_bytes=tile_bytes)

    if strips == "auto":
        return low_memory(fit_strips(build, budget), budget)
    return low_memory(build(strips), budget)


def _tiled(layer: Layer, slices: WeightSlices, trainable_nodes: set[str]) -> dict[str, Layer]:
    """The tiles of ``layer`` as model/tiling.py slices it, then the concat that takes ``layer``'s
    name and place (with activation strips too, where a tile's nodes are its strips)."""
    if layer.op not in ("conv2d", "linear", "embedding") or layer.op == "conv2d" and layer.attrs["groups"] != 1:
        raise PoetError(f"node {layer.name!r}: the firmware tiles only ungrouped convolutions, linear layers and "
                        "embeddings", field="--weight-tile")
    axis = 1 if layer.op == "conv2d" else len(layer.shape) - 1
    if (len(layer.shape) == 4) != (layer.op == "conv2d"):  # model/tiling.py slices (C, H, W) outputs by channel
        raise PoetError(f"node {layer.name!r}: a linear layer with a 4-d output is sliced across its channels, not "
                        "its features; the firmware cannot tile it", field="--weight-tile")
    features = layer.shape[axis]
    out: dict[str, Layer] = {}
    bounds = []
    names = list(slices.names)
    for name, (lo, hi) in feature_ranges(features, names).items():
        shape = tuple(hi - lo if a == axis else d for a, d in enumerate(layer.shape))
        attrs = dict(layer.attrs, features_out=hi - lo) if layer.op == "linear" else dict(layer.attrs)
        if layer.op == "embedding":  # a table's columns: every word's features lo..hi, a block of the table
            params = {role: Parameter(p.torch_name, p.value[:, lo:hi].copy(), (0, p.value.shape[0]),
                                      tuple(p.value.shape), (lo, hi)) for role, p in layer.params.items()}
        else:  # output features lo..hi: the parameters' rows
            params = {role: Parameter(p.torch_name, p.value[lo:hi].copy(), (lo, hi), tuple(p.value.shape))
                      for role, p in layer.params.items()}
        out[name] = Layer(name, layer.op, shape, list(layer.operands), list(layer.operand_shapes), attrs, params,
                          trainable=name in trainable_nodes, origin=layer.origin,
                          operand_views=list(layer.operand_views))
        bounds.append((lo, hi))
    out[layer.name] = Layer(layer.name, "concat", layer.shape, list(names), [out[n].shape for n in names],
                            {"axis": axis, "bounds": bounds}, origin=layer.origin,
                            operand_views=[[] for _ in names])
    return out


def _fx_nodes(ops):
    origin = next(iter(ops.origins.values()), None)
    if origin is None:
        raise PoetError("the module has no operators", field=FIELD)
    return origin.graph.nodes


def _array(t) -> np.ndarray:
    return t.detach().to("cpu").float().numpy().copy()


def _module_params(n, modules) -> list:
    if n.op == "call_module":
        return list(modules[n.target].parameters())
    return []


def _roles(n, modules) -> dict:
    if n.op != "call_module":
        return {}
    m = modules[n.target]
    return {"weight": getattr(m, "weight", None), "bias": getattr(m, "bias", None),
            "running_mean": getattr(m, "running_mean", None), "running_var": getattr(m, "running_var", None)}


NO_KERNEL = "the firmware generator has no kernel for it"  # the executor's lowering says its own (executor/train.py)


def _unsupported(node: str, what: str) -> PoetError:
    return PoetError(f"node {node!r}: {what}; {NO_KERNEL}", field=FIELD)


def _source(arg, producers, modules, node: str, chains: list | None = None) -> str:
    """The operator whose buffer an fx argument reads, through views that keep its layout (any view,
    recorded in ``chains``, when that is a list)."""
    seen, chain = arg, []
    while seen not in producers:
        if seen.op == "get_attr":
            raise _unsupported(node, f"it reads the tensor {seen.target} directly rather than through a layer")
        fn = _fx_callable(seen)
        kind = type(modules[seen.target]).__name__ if seen.op == "call_module" else ""
        moving = chains is not None and fn in _MOVING_VIEWS
        if not (fn in _FLAT_VIEWS or kind in ("Flatten", "Unflatten", "Identity") or moving):
            if fn == "dropout" or kind.startswith("Dropout"):
                raise _unsupported(node, "its input passes through dropout, whose random mask firmware cannot "
                                         "reproduce")
            raise _unsupported(node, f"its input is a view of another tensor ({fn or kind}) that moves elements")
        chain.append(seen)
        seen = seen.args[0]
    if chains is not None:
        chains.append(chain[::-1])
    return producers[seen]


def _fx_callable(n) -> str:
    if n.op == "call_method":
        return str(n.target)
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target)).strip("_")
    return ""


def _tensor_args(n, producers, modules, node: str, chains: list | None = None) -> list[str]:
    import torch.fx

    if any(not isinstance(a, torch.fx.Node) for a in n.args):
        raise _unsupported(node, "an operator with a constant operand")
    return [_source(a, producers, modules, node, chains) for a in n.args]


def _layer(n, o, shapes, producers, modules, chains: list | None = None) -> Layer:
    import torch
    nn = torch.nn

    name, shape = o.name, tuple(int(d) for d in o.shape)
    fn = _fx_callable(n)
    m = modules.get(n.target) if n.op == "call_module" else None

    def make(op, operands, **attrs):
        return Layer(name, op, shape, operands, [shapes[p] for p in operands], attrs)

    if m is not None:
        x = [_source(n.args[0], producers, modules, name, chains)]
        xs = shapes[x[0]]
        if isinstance(m, nn.Conv2d):
            if m.dilation != (1, 1) or m.padding_mode != "zeros" or isinstance(m.padding, str):
                raise _unsupported(name, "a dilated, non-zero-padded or 'same'-padded convolution")
            return make("conv2d", x, kernel=m.kernel_size, stride=m.stride, padding=m.padding, groups=m.groups)
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            if m.momentum is None:
                raise _unsupported(name, "batch norm with a cumulative moving average (momentum=None)")
            return make("batchnorm", x, eps=float(m.eps), momentum=float(m.momentum))
        if isinstance(m, nn.LayerNorm):
            if len(m.normalized_shape) != 1:
                raise _unsupported(name, "layer norm over more than the last dimension")
            return make("layernorm", x, eps=float(m.eps))
        if isinstance(m, nn.Linear):
            return make("linear", x, features_in=m.in_features, features_out=m.out_features)
        if isinstance(m, nn.Embedding):  # the executor runs torch's own gather, the firmware its C kernels
            if m.max_norm is not None or m.sparse:
                raise PoetError(f"node {name!r}: an nn.Embedding with max_norm (renormalised in place by its "
                                "forward) or sparse gradients; the PyTorch executor and the firmware train plain "
                                "tables only",
                                field=FIELD)
            if chains is None and (m.padding_idx is not None or m.scale_grad_by_freq or x[0] != next(iter(shapes))):
                raise _unsupported(name, "an nn.Embedding with padding_idx or scale_grad_by_freq, or indexed by "
                                         "other than the network's input (the token ids) as it is")
            return make("embedding", x, rows=m.num_embeddings)
        spec = next(filter(None, (registry.by_torch_module(c.__name__) for c in type(m).__mro__)), None)
        if spec is not None and spec.split == "elementwise" and spec.arity == 1:  # the registry's activations
            if isinstance(m, nn.GELU) and m.approximate != "none":
                raise _unsupported(name, "GELU's tanh approximation")
            return make(_elementwise(spec, name, f"module {type(m).__name__}", chains), x)
        if isinstance(m, nn.Softmax):
            if m.dim not in (-1, len(xs) - 1):
                raise _unsupported(name, "a softmax over a dimension other than the last")
            return make("softmax", x)
        whole = _executor_module(m, xs, name) if chains is not None else None
        if whole is not None:
            return make(whole, x)
        if isinstance(m, nn.MaxPool2d):
            if m.dilation not in (1, (1, 1)) or m.ceil_mode or m.return_indices:
                raise _unsupported(name, "a dilated or ceil-mode max pooling")
            return make("maxpool", x, kernel=_pair(m.kernel_size), stride=_pair(m.stride or m.kernel_size),
                        padding=_pair(m.padding))
        if isinstance(m, nn.AvgPool2d):
            if m.ceil_mode or not m.count_include_pad or m.divisor_override:
                raise _unsupported(name, "an average pooling with ceil mode, count_include_pad=False or a divisor")
            return make("avgpool", x, kernel=_pair(m.kernel_size), stride=_pair(m.stride or m.kernel_size),
                        padding=_pair(m.padding))
        if isinstance(m, nn.AdaptiveAvgPool2d) and math.prod(shape) == xs[0] * xs[1]:
            return make("global_avgpool", x)
        pooling = registry.by_torch_module(type(m).__name__)
        if chains is not None and pooling is not None and pooling.name in ("maxpool", "avgpool") and \
                not getattr(m, "return_indices", False):  # 1-d, 3-d, adaptive: torch's own, as traced
            return make(pooling.name, x)
        raise _unsupported(name, f"module {type(m).__name__}")
    if fn in _ADD and chains is not None:  # a constant or a broadcast operand too: the executor replays it
        return make("add", _traced_operands(n, registry.spec("add"), len(shape), producers, modules, name, chains))
    if fn in _ADD:
        operands = _tensor_args(n, producers, modules, name, chains)
        if len(operands) != 2 or n.kwargs.get("alpha", 1) != 1 or shapes[operands[0]] != shapes[operands[1]]:
            raise _unsupported(name, "an addition that is not of two tensors of the same shape")
        return make("add", operands)
    spec = registry.by_torch_function(fn)
    if spec is not None and spec.split == "elementwise" and spec.arity == 1:
        if chains is None and (len(n.args) > 1 or set(n.kwargs) - {"inplace"}):  # a slope, an approximation
            raise _unsupported(name, f"{fn} with arguments")
        return make(_elementwise(spec, name, f"operator {fn}", chains),
                    [_source(n.args[0], producers, modules, name, chains)])
    if fn in ("matmul", "bmm") and n.target in (torch.matmul, torch.bmm, operator.matmul) or fn == "matmul":
        operands = _tensor_args(n, producers, modules, name, chains)
        a, b = (shapes[p] for p in operands)
        # (with views the operands' producer shapes are not the product's: the executor replays them)
        if len(operands) != 2 or chains is None and (len(a) != len(b) or a[:-2] != b[:-2] or a[-1] != b[-2]):
            raise _unsupported(name, "a matrix product with broadcasting")
        return make("matmul", operands)
    if fn in ("mean", "adaptive_avg_pool2d", "avg_pool2d"):
        views: list | None = [] if chains is not None else None  # kept only when it is global pooling
        x = [_source(n.args[0], producers, modules, name, views)]
        xs = shapes[x[0]]
        if len(xs) == 4 and math.prod(shape) == xs[0] * xs[1] and (fn != "avg_pool2d"):
            if chains is not None:
                chains.extend(views)
            return make("global_avgpool", x)
    if chains is not None and spec is not None and (spec.name in ("softmax", "log_softmax", "avgpool") or
                                                    spec.split == "whole" and spec.arity == 2):
        return make(spec.name, _traced_operands(n, spec, len(shape), producers, modules, name, chains))
    if spec is not None and spec.name == "softmax":  # the function, as nn.Softmax: over the last axis
        return make("softmax", _traced_operands(n, spec, len(shape), producers, modules, name, chains))
    if fn == "scaled_dot_product_attention" and chains is not None and not n.kwargs and len(n.args) == 3:
        return make("attention", _tensor_args(n, producers, modules, name, chains))
    if o.op == "copy":
        return make("copy", [_source(n.args[0], producers, modules, name, chains)])
    raise _unsupported(name, f"operator {fn or n.target}")


def _elementwise(spec, name: str, what: str, chains) -> str:
    """An activation's op, if the backend that lowers it can run it: the firmware (``chains`` None)
    needs its C kernels, the executor (a list) a backward from what the graph keeps (OpSpec)."""
    if chains is None and spec.c_forward is None:
        raise _unsupported(name, what)
    if chains is not None and spec.saves == "out" and spec.torch_backward is None and spec.torch_backward_call is None:
        raise PoetError(f"node {name!r}: {what}; the PyTorch executor has no backward for it from its output, "
                        "the only tensor the graph keeps for it", field=FIELD)
    return spec.name


def _executor_module(m, xs, name: str) -> str | None:
    """The op of a module only the PyTorch executor runs (whole, torch's own forward and autograd):
    1-d and 3-d convolutions, group and instance norm, log-softmax over the last axis; else None."""
    import torch
    nn = torch.nn

    if isinstance(m, (nn.Conv1d, nn.Conv3d)):
        return "conv1d" if isinstance(m, nn.Conv1d) else "conv3d"
    if isinstance(m, nn.GroupNorm):
        return "groupnorm"
    if isinstance(m, (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)):
        return "instancenorm"  # running statistics move at the first compute only (executor/kernels.py)
    if isinstance(m, nn.LogSoftmax):
        if m.dim not in (-1, len(xs) - 1):
            raise _unsupported(name, "a log-softmax over a dimension other than the last")
        return "log_softmax"
    return None


def _traced_operands(n, spec, rank: int, producers, modules, name: str, chains: list | None) -> list[str]:
    """The tensor operands of a call as traced: a softmax (the firmware's too, ``chains`` None) or
    log-softmax over the last axis; for the PyTorch executor, which replays the call, a mean or sum
    (avgpool: linear, differentiated as traced), or sub, mul, div of tensors and constants (its
    ``_run`` passes the constants as the trace recorded them)."""
    import torch.fx

    tensors = [a for a in n.args if isinstance(a, torch.fx.Node) and "poet_const" not in a.meta]
    if any(isinstance(v, torch.fx.Node) and "poet_const" not in v.meta for v in n.kwargs.values()):
        raise _unsupported(name, f"{spec.name} with a tensor passed by keyword")
    if spec.name in ("softmax", "log_softmax"):
        dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
        if len(tensors) != 1 or not isinstance(dim, int) or dim not in (-1, rank - 1):
            raise _unsupported(name, f"a {spec.name} over a dimension other than the last")
    if spec.name == "avgpool" and len(tensors) != 1:
        raise _unsupported(name, f"a pooling of {len(tensors)} tensors")
    return [_source(a, producers, modules, name, chains) for a in tensors]


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))
