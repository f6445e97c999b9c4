"""Training graphs from PyTorch modules, traced with ``torch.fx``.

``import_torch(module_or_spec, input_shape)`` traces the module symbolically, runs it once on a
zero tensor of ``input_shape`` (batch first) to learn every intermediate shape, and lowers each traced
operation to one of the zoo's forward operators (conv, linear, norms, activations, pooling, add,
concat, matmul, attention, ...). Views (reshape, transpose, flatten, slicing, dropout) are free and
get no node, as in the zoo, unless PyTorch really copies (a reshape of a non-contiguous tensor): that
copy is a tensor in RAM and becomes a ``copy`` node. The backward graph comes from the zoo's rules.

torch is an optional dependency (``pip install 'poet-opt[torch]'``); this module imports it lazily.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import operator
import sys
from pathlib import Path
from typing import Any, Callable

from poet_opt.errors import PoetError
from poet_opt.model.graph import TrainingGraph
from poet_opt.model import ops as registry
from poet_opt.model.operators import (
    OpList,
    attention_flops,
    elements,
    finish,
    parse_full_shape,
    unsupported,
)
from poet_opt.signals import signals_held

FIELD = "--torch"


def _torch():
    try:
        # A Ctrl-C inside torch's own import can come out of its native code as a TypeError ("expected a
        # message argument", distributed_c10d.py; once in CI), with the interrupt lost: held to its end
        with signals_held():
            import torch
            import torch.fx  # noqa: F401
    except ImportError:
        raise PoetError("PyTorch is not installed; pip install 'poet-opt[torch]'", field=FIELD) from None
    return torch


def load_factory(spec: str) -> tuple[Callable[[], Any], str]:
    """``path/to/file.py:factory`` or ``package.module:factory`` -> (the factory, its name)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise PoetError(f"expected FILE.py:FACTORY or package.module:FACTORY, got {spec!r}", field=FIELD)
    where, attr = spec.rsplit(":", 1)
    where, attr = where.strip(), attr.strip()
    if not where or not attr.isidentifier():
        raise PoetError(f"expected FILE.py:FACTORY or package.module:FACTORY, got {spec!r}", field=FIELD)
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _module_from_file(Path(where), spec)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise PoetError(f"cannot import {where!r}: {exc}", field=FIELD) from None
        except Exception as exc:
            raise PoetError(f"importing {where!r} failed: {_one_line(exc)}", field=FIELD) from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(attr, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise PoetError(f"{where} has no {attr!r}{hint}", field=FIELD)
    return getattr(module, attr), attr


def _module_from_file(path: Path, spec: str):
    if not path.is_file():
        raise PoetError("no such Python file", source=str(path), field=FIELD)
    module_name = f"_poet_user_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    # the user's file may import its neighbours
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise PoetError(f"running the file failed: {_one_line(exc)}", source=str(path), field=FIELD) from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def import_torch(model, input_shape, *, bytes_per_element: int = 4, trainable="all",
                 known_costs=frozenset(), name: str | None = None, weights: str = "resident",
                 optimizer: str = "none", tile_bytes: int | None = None) -> TrainingGraph:
    """The training graph of a ``torch.nn.Module`` (or of ``FILE.py:FACTORY`` / ``module:FACTORY``,
    or of a factory), for an input of ``input_shape`` (the whole tensor, batch first: ``1,3,32,32``).

    ``trainable`` is ``all``, ``last:N`` or layer names, as for zoo models. Operators poet-opt has no
    FLOP rule for are accepted when ``known_costs`` (node names or operator types of a measured-cost
    file) times them."""
    torch = _torch()
    shape = parse_full_shape(input_shape)
    module, default_name = resolve_module(model)
    ops, output = _lower(torch, module, shape, frozenset(known_costs))
    meta = {"source": model if isinstance(model, str) else default_name, "format": "torch.fx",
            "input_shape": list(shape), "batch_size": shape[0]}
    dropped = dropout_node(module, ops)
    if dropped is not None:  # planned as a view, which no backend can train as torch does (model/load.py)
        meta["dropout"] = dropped
    return finish(name or default_name, ops.ops, output, bytes_per_element=bytes_per_element,
                  trainable=trainable, meta=meta, field=FIELD, weights=weights, optimizer=optimizer,
                  tile_bytes=tile_bytes)


def resolve_module(model):
    """(the nn.Module, its default name) from a module, a factory or ``FILE.py:FACTORY``."""
    torch = _torch()
    if isinstance(model, str):
        factory, default_name = load_factory(model)
    elif isinstance(model, torch.nn.Module):
        factory, default_name = (lambda: model), type(model).__name__
    elif callable(model):
        factory, default_name = model, getattr(model, "__name__", "model")
    else:
        raise PoetError(f"expected an nn.Module, a factory or FILE.py:FACTORY, got {type(model).__name__}",
                        field=FIELD)
    module = factory
    if not isinstance(factory, torch.nn.Module):
        try:
            module = factory()
        except Exception as exc:
            raise PoetError(f"{default_name}() failed: {_one_line(exc)}", field=FIELD) from None
    if not isinstance(module, torch.nn.Module):
        raise PoetError(f"{default_name} returned a {type(module).__name__}, not a torch.nn.Module", field=FIELD)
    return module, default_name


def lower_module(module, input_shape, *, known_costs=frozenset()):
    """The forward operators of ``module`` on an input of ``input_shape`` and the index of the one it
    returns; ``ops.origins`` maps each operator's name to the torch.fx node it came from."""
    torch = _torch()
    return _lower(torch, module, parse_full_shape(input_shape), frozenset(known_costs))


# -- tracing -----------------------------------------------------------------------------------------

def _tracer(torch):
    class ScopedTracer(torch.fx.Tracer):
        """Records, for each traced node, the qualified name of the module whose forward made it,
        so that functional ops get names like ``layer1.0.add`` (the zoo's)."""

        def __init__(self):
            super().__init__()
            self._poet_scopes: list[str] = [""]

        def call_module(self, m, forward, args, kwargs):
            self._poet_scopes.append(self.path_of_module(m))
            try:
                return super().call_module(m, forward, args, kwargs)
            finally:
                self._poet_scopes.pop()

        def create_node(self, *args, **kwargs):
            node = super().create_node(*args, **kwargs)
            node.meta["poet_scope"] = self._poet_scopes[-1]
            return node

    return ScopedTracer()


def _trace(torch, module):
    tracer = _tracer(torch)
    try:
        graph = tracer.trace(module)
    except Exception as exc:
        raise PoetError(f"torch.fx cannot trace {type(module).__name__}: {_one_line(exc)}", field=FIELD) from None
    return graph


def _run(torch, module, graph, shape):
    """Every node's real value on a zero input (eval mode: batch norm uses its running statistics,
    so a batch of one works and the module's state is left alone)."""
    # The graph is interpreted on the module itself: a GraphModule would write submodule names into
    # Python source, which torch.fx does without escaping (a quote, a newline or a trailing
    # backslash in a name is a SyntaxError), and a name is the user's data, not code.
    values: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n] = out
            if not isinstance(out, torch.Tensor):  # sizes and other constants the executor replays views with
                n.meta["poet_const"] = out
            return out

    was_training = module.training
    module.eval()
    dtype = torch.long if _reads_token_ids(torch, graph, module) else torch.float32
    try:
        with torch.no_grad():
            Recorder(module, graph=graph).run(torch.zeros(shape, dtype=dtype))
    except Exception as exc:
        raise PoetError(f"running {type(module).__name__} on an input of shape {tuple(shape)} failed: "
                        f"{_one_line(exc)}", field="--input-shape") from None
    finally:
        module.train(was_training)
    return values


def _reads_token_ids(torch, graph, module) -> bool:
    """A network whose input goes straight into an embedding takes integer token ids."""
    modules = dict(module.named_modules())
    for n in graph.nodes:
        if n.op == "placeholder":
            return any((u.op == "call_module" and isinstance(modules.get(u.target), torch.nn.Embedding))
                       or (u.op == "call_function" and getattr(u.target, "__name__", "") == "embedding")
                       for u in n.users)
    return False


def _lower(torch, module, shape, known_costs) -> tuple[OpList, int]:
    graph = _trace(torch, module)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise PoetError(f"{type(module).__name__}.forward takes {len(placeholders)} inputs; poet-opt imports "
                        "modules with one input tensor", field=FIELD)
    values = _run(torch, module, graph, shape)
    ops = OpList(shape, "input")
    producer: dict = {placeholders[0]: 0}  # fx node -> index of the op whose tensor it is (views share)
    seen_params: set[int] = set()
    modules = dict(module.named_modules())
    output = None
    for n in graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            output = _output_op(torch, n, producer)
            break
        if n.op == "get_attr":
            continue  # parameters and buffers: counted by the op that reads them
        value = values.get(n)
        act_inputs = [a for a in n.all_input_nodes if a in producer]
        if not act_inputs:
            continue  # shapes, sizes and constants: bookkeeping, not activations
        lowered = _lower_node(torch, n, value, act_inputs, producer, values, modules, known_costs)
        if lowered is None:
            continue
        if lowered == "alias":
            producer[n] = producer[act_inputs[0]]
            continue
        op, flops, saves, module_params = lowered
        params = _count_params(torch, module_params + _attr_params(module, n), seen_params)
        if not isinstance(value, torch.Tensor):
            raise PoetError(f"node {_name(n)!r} ({op}) returns a {type(value).__name__}, not a tensor; poet-opt "
                            "follows single-tensor operators", field=FIELD)
        inputs = [producer[a] for a in act_inputs]
        producer[n] = ops.add(_name(n), op, inputs, value.shape, flops, params, saves)
        ops.origins[ops.ops[producer[n]].name] = n
    if output is None:
        raise PoetError("the traced module has no output", field=FIELD)
    return ops, output


def _output_op(torch, n, producer) -> int:
    outs = [a for a in n.all_input_nodes if a in producer]
    if len(outs) != 1:
        raise PoetError(f"the module returns {len(outs)} tensors; poet-opt puts the loss on a single output "
                        "(wrap the module to return the one you train on)", field=FIELD)
    return producer[outs[0]]


def _name(n) -> str:
    if n.op == "call_module":
        return str(n.target)
    base = n.target.__name__ if callable(n.target) else str(n.target)
    base = base.strip("_").lower() or n.name
    scope = n.meta.get("poet_scope", "")
    return f"{scope}.{base}" if scope else base


def _count_params(torch, tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:  # a shared (tied) parameter is stored and trained once
        if isinstance(t, torch.nn.Parameter) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel()
    return total


def _attr_params(module, n) -> list:
    """Parameters an op reads through get_attr (``x * self.scale``, ``F.linear(x, self.w)``)."""
    found = []
    for a in n.all_input_nodes:
        if a.op == "get_attr":
            obj = module
            for part in str(a.target).split("."):
                obj = getattr(obj, part)
            found.append(obj)
    return found


_VIEW_METHODS = {"view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "squeeze",
                 "unsqueeze", "expand", "expand_as", "view_as", "reshape_as", "narrow", "chunk", "split", "unbind",
                 "detach", "clone", "float", "type_as", "to", "__getitem__", "getitem", "movedim", "swapaxes"}


def dropout_node(module, ops) -> str | None:
    """The first dropout of a traced module, which the graph takes as a view (its random mask has
    no FLOPs worth counting), or None. No backend trains through it as torch does: a recompute
    would draw another mask."""
    modules = dict(module.named_modules())
    origin = next(iter(ops.origins.values()), None)
    for n in origin.graph.nodes if origin is not None else ():
        m = modules.get(n.target) if n.op == "call_module" else None
        if n.op in ("call_function", "call_method") and _callable_name(n) == "dropout" or \
                m is not None and type(m).__name__.startswith("Dropout"):
            return n.name
    return None


def dropout_refusal(node: str) -> PoetError:
    return PoetError(f"node {node!r}: dropout, whose random mask no backend reproduces (recomputing a node would "
                     "draw another); train the module without it", field=FIELD)


def _callable_name(n) -> str:
    if n.op == "call_method":
        return str(n.target)
    return getattr(n.target, "__name__", str(n.target)).strip("_")


def _arithmetic_saves(torch, spec, n, producer) -> str:
    """What the backward of a + b, a - b, a * b, a / b reads: d(a*b)/da reads b, so a product of two
    activations keeps the other operand, a square x * x its input; d(a/b)/db = -a/b^2 reads both, so
    a division by an activation keeps its inputs; a constant operand leaves the rest linear: nothing."""
    args = [a for a in n.args[:2]]
    tensors = [producer[a] for a in args if isinstance(a, torch.fx.Node) and a in producer]
    if spec.name == "div" and len(args) == 2 and isinstance(args[1], torch.fx.Node) and args[1] in producer:
        return "in"
    if spec.saves == "other" and len(tensors) == 2:
        return "other" if tensors[0] != tensors[1] else "in"
    return ""


def _lower_node(torch, n, value, act_inputs, producer, values, modules, known_costs):
    """-> None (not an activation), "alias" (a view of its first input), or
    (op, flops, saves, parameters it owns)."""
    if n.op == "call_module":
        return _lower_module(torch, n, modules[n.target], value, act_inputs, values, known_costs)
    fn = _callable_name(n)
    if fn in _VIEW_METHODS or n.target in (torch.flatten, torch.reshape, torch.transpose, torch.permute,
                                           torch.squeeze, torch.unsqueeze, torch.chunk, torch.split,
                                           torch.nn.functional.dropout, operator.getitem):
        if fn in ("reshape", "contiguous", "flatten", "clone") and isinstance(value, torch.Tensor) \
                and not _shares_storage(value, values.get(act_inputs[0])):
            return "copy", 0.0, "", []  # PyTorch copied a non-contiguous tensor: a real tensor
        return "alias"
    if fn == "dropout":
        return "alias"
    if not isinstance(value, torch.Tensor):
        return None
    out = value.numel()
    spec = registry.by_torch_function(fn)
    if spec is not None and spec.arity == 2 and spec.flops_per_element is not None:  # add, sub, mul, div
        return spec.name, spec.flops(out), _arithmetic_saves(torch, spec, n, producer), []
    if spec is not None and spec.name == "concat":
        return spec.name, spec.flops(out), spec.saves, []
    if spec is not None and spec.name == "matmul":
        a = values[n.args[0]]
        return "matmul", 2.0 * out * a.shape[-1], "other", []
    if spec is not None and spec.name == "attention":
        q, k, v = (values[a] for a in n.args[:3])
        batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
        return "attention", attention_flops(batch_heads, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]), \
            "in+out", []  # flash attention keeps q, k, v and its output
    if spec is not None and spec.flops_per_element is not None:  # activations, norms, embedding: per element
        return spec.name, spec.flops(out), spec.saves, []
    if fn == "linear":
        return "linear", 2.0 * out * values[n.args[0]].shape[-1], "", []
    if fn in ("conv1d", "conv2d", "conv3d"):
        weight = values.get(n.args[1]) if len(n.args) > 1 else None
        if not isinstance(weight, torch.Tensor):
            raise PoetError(f"cannot read the weight of {_name(n)!r} ({fn})", field=FIELD)
        return fn, 2.0 * out * weight[0].numel(), "", []
    if fn in ("max_pool1d", "max_pool2d", "max_pool3d"):
        k = n.args[1] if len(n.args) > 1 else n.kwargs.get("kernel_size")
        return "maxpool", float(out * _window(k, value.dim() - 2)), "in", []
    if fn in ("avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "mean", "sum"):
        return "avgpool", float(values[act_inputs[0]].numel()), "", []
    if fn in ("adaptive_max_pool2d", "amax", "max"):
        return "maxpool", float(values[act_inputs[0]].numel()), "in", []
    unsupported(fn, _name(n), known_costs, FIELD)
    return fn, 0.0, "in", []


def _shares_storage(a, b) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except Exception:
        return True


def _window(kernel, dims: int) -> int:
    if isinstance(kernel, int):
        return kernel ** dims
    size = 1
    for k in kernel:
        size *= k
    return size


def _lower_module(torch, n, m, value, act_inputs, values, known_costs):
    nn = torch.nn
    params = list(m.parameters())
    if isinstance(m, (nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)):
        return "alias"
    if not isinstance(value, torch.Tensor):
        unsupported(type(m).__name__, str(n.target), known_costs, FIELD)
        return None
    out = value.numel()
    x = values[act_inputs[0]]
    if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        per_output = (m.in_channels // m.groups) * elements(m.kernel_size)
        return f"conv{len(m.kernel_size)}d", 2.0 * out * per_output, "", params
    if isinstance(m, nn.Linear):
        return "linear", 2.0 * out * m.in_features, "", params
    spec = next(filter(None, (registry.by_torch_module(c.__name__) for c in type(m).__mro__)), None)
    if spec is not None and spec.flops_per_element is not None:  # norms and activations: per element
        return spec.name, spec.flops(out), spec.saves, params
    if isinstance(m, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        return "maxpool", float(out * _window(m.kernel_size, value.dim() - 2)), "in", params
    if isinstance(m, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d)):
        return "maxpool", float(x.numel()), "in", params
    if isinstance(m, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        return "avgpool", float(out * _window(m.kernel_size, value.dim() - 2)), "", params
    if isinstance(m, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        return "avgpool", float(x.numel()), "", params
    op = type(m).__name__
    unsupported(op, str(n.target), known_costs, FIELD)
    return op, 0.0, "in", params

