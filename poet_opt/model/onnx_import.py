"""Training graphs from ONNX files, with the ``onnx`` package's shape inference.

Operators are lowered to the same forward operators as the PyTorch importer (so one network gives the
same graph either way): a MatMul by a weight plus the Add of its bias is one ``linear``, as is Gemm;
BatchNormalization, LayerNormalization, activations, pooling, Add/Mul, Concat, MatMul of two
activations and Attention (opset 23) have their FLOP rules; shape plumbing (Reshape, Transpose,
Flatten, Squeeze, Identity, Dropout, ...) is free, as in the zoo. Initializers are weights: an
operator owns those it reads. An ONNX exporter may merge equal initializers (freshly initialised
norms), so weights are counted per operator, not per unique initializer.

Export from PyTorch for training keeps batch norm: ``torch.onnx.export(model, (x,), path, dynamo=False,
training=torch.onnx.TrainingMode.TRAINING)``; the exporter's default (eval) folds it into the conv.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

from poet_opt.errors import PoetError
from poet_opt.model.graph import TrainingGraph
from poet_opt.model import ops as registry
from poet_opt.model.operators import (
    OpList,
    attention_flops,
    finish,
    parse_full_shape,
    unsupported,
)

FIELD = "--onnx"

VIEWS = {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Cast", "Expand",
         "Slice", "Split"}
METADATA = {"Shape", "Size", "ConstantOfShape", "NonZero"}  # outputs describe tensors; they are not tensors
# ONNX op types the registry costs per element and that read one activation: activations, softmax
ACTIVATIONS = {t: s.name for s in registry.specs() for t in s.onnx if s.flops_per_element is not None and s.arity == 1
               and s.family in ("activations", "attention")}
BINARY = {t: s.name for s in registry.specs() for t in s.onnx if s.arity == 2 and s.flops_per_element is not None}
NORMS = {t: s.name for s in registry.specs() for t in s.onnx if s.family == "norm"}
FLOAT_TYPES = {1, 10, 11, 16}  # float, float16, double, bfloat16


def _onnx():
    try:
        import onnx
    except ImportError:
        raise PoetError("the onnx package is not installed; pip install 'poet-opt[onnx]'", field=FIELD) from None
    return onnx


def import_onnx(path, *, input_shape=None, bytes_per_element: int = 4, trainable="all",
                known_costs=frozenset(), name: str | None = None, weights: str = "resident",
                optimizer: str = "none", tile_bytes: int | None = None) -> TrainingGraph:
    """The training graph of an ONNX model. ``input_shape`` (batch first) fixes the input's symbolic
    dimensions; without it the file's own shapes are used and must be complete."""
    placement = weights  # the name is taken below, by the initializers
    onnx = _onnx()
    source = str(path)
    if not Path(source).is_file():
        raise PoetError("no such ONNX file", source=source, field=FIELD)
    try:
        model = onnx.load(source)
    except Exception as exc:
        raise PoetError(f"not a readable ONNX model: {' '.join(str(exc).split())[:200]}", source=source,
                        field=FIELD) from None
    graph = model.graph
    weights = {t.name: tuple(t.dims) for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in weights]
    if len(inputs) != 1:
        raise PoetError(f"the model has {len(inputs)} inputs; poet-opt imports models with one input tensor",
                        source=source, field=FIELD)
    if input_shape is not None:
        shape = parse_full_shape(input_shape)
        dims = inputs[0].type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise PoetError(f"the model's input {inputs[0].name!r} has {len(dims)} dimensions, --input-shape gives "
                            f"{len(shape)}", source=source, field="--input-shape")
        for dim, size in zip(dims, shape):
            dim.ClearField("dim_param")
            dim.dim_value = size
    try:
        # not strict: an operator inference cannot follow leaves its outputs without a shape, and the
        # error below names the first such tensor poet-opt needs
        model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:
        raise PoetError(f"ONNX shape inference failed: {' '.join(str(exc).split())[:300]}", source=source,
                        field=FIELD) from None
    graph = model.graph
    shapes: dict[str, tuple] = {}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim)
    constants = set(weights)
    for node in graph.node:
        if node.op_type == "Constant":
            constants.update(node.output)
            for attr in node.attribute:  # some exporters store weights as Constant nodes
                if attr.name == "value":
                    weights[node.output[0]] = tuple(attr.t.dims)
    shapes.update(weights)

    def shape_of(tensor: str, producer: str) -> tuple[int, ...]:
        dims = shapes.get(tensor)
        if dims is None or any(d is None or d < 1 for d in dims):
            what = "has no shape" if dims is None else f"has the symbolic shape {tuple(d or '?' for d in dims)}"
            raise PoetError(f"tensor {tensor!r} (output of {producer}) {what} after shape inference; give the "
                            "input's shape with --input-shape, batch first, or export with static shapes",
                            source=source, field=FIELD)
        return tuple(int(d) for d in dims)

    input_name = inputs[0].name
    ops = OpList(shape_of(input_name, "the graph input"), "input")
    producer: dict[str, int] = {input_name: 0}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for t in node.input:
            consumers.setdefault(t, []).append(node)
    fused: dict[str, tuple[int, int]] = {}  # Add output -> (linear op, bias elements)
    for node in graph.node:
        acts = [t for t in node.input if t in producer]
        if not acts:
            constants.update(node.output)  # folded shape arithmetic and constants
            if node.op_type in ("Identity", "Cast") and node.input and node.input[0] in weights:
                weights[node.output[0]] = weights[node.input[0]]  # an exporter's merge of equal weights
            continue
        label = _label(node)
        op_type = node.op_type
        if op_type in METADATA:
            constants.update(node.output)
            continue
        if op_type in VIEWS:
            for out in node.output:
                if out:
                    producer[out] = producer[acts[0]]
            continue
        if op_type == "Add" and node.output[0] in fused:
            continue
        if op_type == "Gather" and node.input[0] in producer:  # indexing an activation: x[:, 0]
            producer[node.output[0]] = producer[node.input[0]]
            continue
        out = node.output[0]
        out_shape = shape_of(out, f"{op_type} {node.name!r}")
        out_elems = math.prod(out_shape)
        # a scalar initializer is a hyper-parameter (a scale, an epsilon), not a weight
        owned = [t for t in node.input if t and t in constants and t in weights and math.prod(weights[t]) > 1]
        params = sum(math.prod(weights[t]) for t in owned)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        saves, flops = "", 0.0
        if op_type == "Conv":
            w = weights.get(node.input[1]) or shape_of(node.input[1], label)
            kind, flops = f"conv{len(w) - 2}d", 2.0 * out_elems * math.prod(w[1:])
        elif op_type == "Gemm":
            a = shape_of(node.input[0], label)
            kind, flops = "linear", 2.0 * out_elems * a[0 if attrs.get("transA") else -1]
        elif op_type == "MatMul" and node.input[1] in constants:
            a = shape_of(node.input[0], label)
            kind, flops = "linear", 2.0 * out_elems * a[-1]
            bias = _bias_add(out, consumers, constants, weights)
            if bias is not None:  # MatMul + Add(bias) is one nn.Linear
                add, bias_elems = bias
                params += bias_elems
                out = add.output[0]
                out_shape = shape_of(out, f"Add {add.name!r}")
                fused[out] = (len(ops.ops), bias_elems)
        elif op_type == "MatMul":
            a = shape_of(node.input[0], label)
            kind, flops, saves = "matmul", 2.0 * out_elems * a[-1], "other"
        elif op_type in BINARY:
            kind, flops = BINARY[op_type], float(out_elems)
            # d(a/b)/db = -a/b^2 reads both inputs; d(a*b)/da reads b; a square x * x reads x
            saves = "in" if kind == "div" and node.input[1] in acts or kind == "mul" and len(acts) == 2 and \
                producer[acts[0]] == producer[acts[1]] else "other" if kind == "mul" and len(acts) == 2 else ""
        elif op_type == "Clip":
            kind = "relu6" if _clip_bounds(node, attrs, graph) == (0.0, 6.0) else "clip"
            per, saves = registry.elementwise_rule(kind)
            flops = float(per * out_elems)
        elif op_type in ACTIVATIONS:
            kind = ACTIVATIONS[op_type]
            per, saves = registry.elementwise_rule(kind)
            flops = float(per * out_elems)
        elif op_type in NORMS:
            kind = NORMS[op_type]
            if kind == "batchnorm":  # running mean and variance are buffers, not trained weights
                params = sum(math.prod(weights[t]) for t in node.input[1:3] if t in weights)
            flops, saves = registry.elementwise_rule(kind)
            flops = float(flops * out_elems)
        elif op_type == "MaxPool":
            kind, flops, saves = "maxpool", float(out_elems * math.prod(attrs.get("kernel_shape", [1]))), "in"
        elif op_type == "AveragePool":
            kind, flops = "avgpool", float(out_elems * math.prod(attrs.get("kernel_shape", [1])))
        elif op_type in ("GlobalAveragePool", "ReduceMean"):
            kind, flops = "avgpool", float(math.prod(shape_of(acts[0], label)))
        elif op_type in ("GlobalMaxPool", "ReduceMax"):
            kind, flops, saves = "maxpool", float(math.prod(shape_of(acts[0], label))), "in"
        elif op_type == "Concat":
            kind, flops = "concat", float(out_elems)
        elif op_type == "Attention":
            kind, flops, saves = "attention", _attention(node, attrs, shape_of, label), "in+out"
        elif op_type == "Gather" and node.input[0] in weights:
            kind, flops = "embedding", float(out_elems)
        else:
            unsupported(op_type, label, frozenset(known_costs), FIELD)
            kind, saves = op_type, "in"
        op_inputs = [producer[t] for t in node.input if t in producer]
        index = ops.add(label, kind, op_inputs, out_shape, flops, params, saves)
        producer[out] = index
        for extra in node.output[1:]:
            if extra:
                constants.add(extra)  # batch norm's running statistics, attention's optional outputs
    outputs = [o.name for o in graph.output if o.name in producer]
    if len(outputs) != 1:
        raise PoetError(f"the model has {len(outputs)} outputs computed from its input; poet-opt puts the loss "
                        "on a single output", source=source, field=FIELD)
    meta = {"source": source, "format": "onnx", "input_shape": list(ops.ops[0].shape),
            "batch_size": ops.ops[0].shape[0]}
    return finish(name or Path(source).stem, ops.ops, producer[outputs[0]], bytes_per_element=bytes_per_element,
                  trainable=trainable, meta=meta, field=FIELD, weights=placement, optimizer=optimizer,
                  tile_bytes=tile_bytes)


def _label(node) -> str:
    """'/layer1/layer1.0/conv1/Conv' (torch's exporter) -> 'layer1.0.conv1', the module's qualified
    name; a functional op in a module gets its type: '/layer1/layer1.0/Add' -> 'layer1.0.add'."""
    name = node.name or node.op_type
    scoped = _dynamo_label(node)
    if scoped:
        return scoped
    if name.startswith("/"):
        parts = [p for p in name.split("/") if p]
        segments: list[str] = []
        for part in parts[:-1]:  # a Sequential's child repeats its parent: layer1/layer1.0, downsample/downsample.0
            if segments and part.startswith(segments[-1] + "."):
                segments[-1] = part
            else:
                segments.append(part)
        scope = ".".join(segments)
        last = parts[-1].split("_")[0]
        if scope and last.lower() == node.op_type.lower() and _names_module(node.op_type):
            return scope
        return f"{scope}.{node.op_type.lower()}" if scope else node.op_type.lower()
    if name.startswith("node_"):  # the dynamo exporter names nodes after the aten op
        return name[len("node_"):]
    return name


def _literal_list(text: str) -> list | None:
    """A Python list literal from node metadata, or None for anything else (a scalar, a string,
    text that is not a literal at all, one nested too deeply)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return list(value) if isinstance(value, (list, tuple)) else None


def _dynamo_label(node) -> str | None:
    """torch's dynamo exporter records the module path of each node in its metadata."""
    props = {p.key: p.value for p in node.metadata_props}
    if "pkg.torch.onnx.name_scopes" not in props:
        return None
    scopes = _literal_list(props["pkg.torch.onnx.name_scopes"])
    classes = _literal_list(props.get("pkg.torch.onnx.class_hierarchy", "[]"))
    if scopes is None or classes is None:  # metadata is the file's to say: a label is only a name
        return None
    scopes, classes = [str(s) for s in scopes if s], [str(c) for c in classes]
    if not scopes:
        return None
    segments: list[str] = []
    for part in scopes[:-1]:
        if segments and part.startswith(segments[-1] + "."):
            segments[-1] = part
        else:
            segments.append(part)
    scope = ".".join(segments)
    if scope and len(classes) >= 2 and classes[-2].startswith("torch.nn.modules."):
        return scope  # the op of a torch.nn layer is named after the layer
    base = re.sub(r"_\d+$", "", scopes[-1])
    return f"{scope}.{base}" if scope else base


def _names_module(op_type: str) -> bool:
    # ops that are a whole nn.Module in torch; an Add inside a block is the block's functional add
    return op_type in {"Conv", "Gemm", "MatMul", "BatchNormalization", "LayerNormalization", "GroupNormalization",
                       "InstanceNormalization", "MaxPool", "AveragePool", "GlobalAveragePool", "Clip", "Gather",
                       "Attention"} | set(ACTIVATIONS)


def _bias_add(out: str, consumers, constants, weights):
    users = consumers.get(out, [])
    if len(users) != 1 or users[0].op_type != "Add":
        return None
    add = users[0]
    other = [t for t in add.input if t != out]
    if len(other) != 1 or other[0] not in weights:
        return None
    return add, math.prod(weights[other[0]])


def _clip_bounds(node, attrs, graph):
    if "min" in attrs or "max" in attrs:
        return float(attrs.get("min", -math.inf)), float(attrs.get("max", math.inf))
    from onnx import numpy_helper

    values = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    values[n.output[0]] = a.t
    bounds = []
    for t in list(node.input[1:3]) + [""] * (3 - len(node.input)):
        bounds.append(float(numpy_helper.to_array(values[t]).reshape(-1)[0]) if t in values else None)
    return tuple(bounds)


def _attention(node, attrs, shape_of, label) -> float:
    q, k, v = (shape_of(t, label) for t in node.input[:3])
    if len(q) == 4:  # (batch, heads, seq, head_dim)
        return attention_flops(q[0] * q[1], q[2], k[2], q[3], v[3])
    heads = int(attrs.get("q_num_heads", 1))
    kv_heads = int(attrs.get("kv_num_heads", heads))
    return attention_flops(q[0] * heads, q[1], k[1], q[2] // heads, v[2] // kv_heads)
