"""What each node of a training graph computes, in PyTorch, from the tensors a schedule holds.

The training graph's semantics (poet_opt.model.zoo) decide what a node computes, as the firmware
generator (firmware/writer.py) reads them:

- a forward node runs its layer: the fx node it was traced from, on its producers' outputs (through
  the views recorded between them, ``Layer.operand_views``);
- ``loss`` holds the per-sample cross-entropy of the logits, flattened per sample (the firmware's
  and `poet-opt emulate`'s convention);
- ``grad:f`` is the gradient of the loss with respect to f's output: one contribution per user u of
  f (the data gradient back through u, from ``grad:u`` and what u saved), plus the cross-entropy
  gradient when f is the logits; and, when f has trainable weights, their gradients, which read
  f's inputs.

A data gradient reads only the tensors the graph says it reads (its node's ``deps``), since those
are the ones the schedule keeps resident: a convolution's or a linear layer's input gradient needs
the weights only, a ReLU's its output, a product's the other operand. Operators whose backward
reads their inputs (batch, layer, group and instance norm, GELU, ReLU6, pooling, a division by an
activation, attention) are differentiated by autograd on a re-run of their forward from those
inputs, which gives exactly the gradient PyTorch's own backward gives; an operand the graph does not
keep is one the operator is linear in (a difference, a product's own factor), re-run at zero. ELU
and sqrt go back from their output by torch's formula for the traced call (its alpha, rsqrt).
Side effects happen once per step: batch and instance norm's running statistics move only at a
node's first compute, weight gradients accumulate only at ``grad:f``'s first compute.
"""

from __future__ import annotations

from poet_opt.errors import PoetError
from poet_opt.model import ops as registry
from poet_opt.model.network import Layer, Network

# Operators whose data gradient is written out below. Those whose backward reads their output
# (relu, softmax, tanh, ...) use the registry's torch backward (OpSpec.torch_backward) on it; any
# other is differentiated by re-running its forward from its inputs (all of them resident: the
# graph's rule "in" for these operators).
_EXPLICIT = {"conv2d", "linear", "add", "copy", "global_avgpool", "matmul"}
# Linear operators whose backward reads nothing (the graph keeps no input for them: avgpool, neg):
# differentiated on a zero broadcast to the input's shape, which holds one number, not the input
_LINEAR = {s.name for s in registry.specs() if s.saves == "" and s.arity == 1} - _EXPLICIT
_INPLACE_FUNCTIONS = {"iadd", "isub", "imul", "itruediv"}


class Kernels:
    """Forward, loss and backward of every node of ``network``, on ``device``."""

    def __init__(self, network: Network, device):
        import torch

        self.torch = torch
        self.net = network
        self.device = device
        self.modules = dict(network.module.named_modules())
        named = dict(network.module.named_parameters())
        # torch name -> the module's own parameter tensor (the executor trains the module in place)
        self.params = {p.torch_name: named[p.torch_name] for layer in network.layers.values()
                       for p in layer.params.values() if p.torch_name in named}
        self.users: dict[str, list[Layer]] = {name: [] for name in network.layers}
        for layer in network.layers.values():
            if layer.origin is None and layer.op != "input":
                raise PoetError(f"internal: layer {layer.name!r} was lowered without views=True")
            for operand in dict.fromkeys(layer.operands):
                self.users[operand].append(layer)
        # per gradient node grad:f, the tensors the graph keeps resident for it (its deps)
        by_id = {n.id: n.name for n in network.graph.nodes}
        self.kept = {n.name[len("grad:"):]: {by_id[d] for d in n.deps} for n in network.graph.nodes
                     if n.kind == "backward" and n.name.startswith("grad:")}
        self.x = self.y = None

    # -- helpers -----------------------------------------------------------------------------------

    def _const(self, a):
        """An fx argument that is not a tensor operand: its value from the trace."""
        fx = self.torch.fx
        if isinstance(a, fx.Node):
            if "poet_const" not in a.meta:
                raise PoetError(f"internal: fx node {a.name} has no traced value")
            return a.meta["poet_const"]
        if isinstance(a, (list, tuple)):
            return type(a)(self._const(v) for v in a)
        if isinstance(a, dict):
            return {k: self._const(v) for k, v in a.items()}
        return a

    def _call(self, n, args, kwargs):
        if n.op == "call_module":
            return self.modules[n.target](*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        return n.target(*args, **kwargs)

    def _view(self, t, chain):
        for v in chain:
            t = self._call(v, (t, *self._const(tuple(v.args[1:]))), self._const(dict(v.kwargs)))
        return t

    def operand(self, layer: Layer, which: int, table: dict):
        return self._view(table[layer.operands[which]], layer.operand_views[which])

    def _unview(self, shape, chain, grad_view):
        """The gradient with respect to a producer's output (of ``shape``) of one with respect to its
        view. The producer need not be resident: the views run on one zero broadcast to its shape."""
        if not chain:
            return grad_view
        with self.torch.enable_grad():
            p = grad_view.new_zeros(()).requires_grad_(True).expand(shape)
            (g,) = self.torch.autograd.grad(self._view(p, chain), p, grad_view)
        return g

    def _run(self, layer: Layer, operands, *, first: bool):
        """The layer's fx node on ``operands`` (viewed, in argument order)."""
        torch = self.torch
        n = layer.origin
        if layer.op == "batchnorm":
            m = self.modules[n.target]
            if first:
                return m(operands[0])  # in training mode: moves the running statistics, as plain training
            # a recompute: the same batch statistics, running statistics left alone
            return torch.nn.functional.batch_norm(operands[0], None, None, m.weight, m.bias, True, 0.0, m.eps)
        if layer.op == "instancenorm" and not first and self.modules[n.target].track_running_stats:
            m = self.modules[n.target]  # a recompute: the instance statistics, running statistics left alone
            return torch.nn.functional.instance_norm(operands[0], None, None, m.weight, m.bias, True, 0.0, m.eps)
        fx = torch.fx
        it = iter(operands)
        args = tuple(next(it) if isinstance(a, fx.Node) and "poet_const" not in a.meta else self._const(a)
                     for a in n.args)
        return self._call(n, args, self._const(dict(n.kwargs)))

    # -- nodes -------------------------------------------------------------------------------------

    def forward(self, name: str, table: dict, *, first: bool):
        layer = self.net.layers[name]
        if layer.op == "input":
            return self.x
        operands = [self.operand(layer, i, table) for i in range(len(layer.operands))]
        if self._in_place(layer):  # ReLU(inplace=True), x += y: the producers' outputs stay as they are
            operands = [o.clone() for o in operands]
        with self.torch.no_grad():
            out = self._run(layer, operands, first=first)
        return out if out.is_contiguous() else out.contiguous()

    def _in_place(self, layer: Layer) -> bool:
        n = layer.origin
        if n.op == "call_module":
            return bool(getattr(self.modules[n.target], "inplace", False))
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        return str(name).strip("_") in _INPLACE_FUNCTIONS or str(name).endswith("_") or bool(n.kwargs.get("inplace"))

    def logits2d(self, logits):
        return logits.reshape(logits.shape[0], -1)

    def loss(self, table: dict):
        """Per-sample cross-entropy (the loss node's bytes: one value per sample)."""
        with self.torch.no_grad():
            return self.torch.nn.functional.cross_entropy(self.logits2d(table[self.net.output]), self.y,
                                                          reduction="none")

    def backward(self, name: str, table: dict, *, first: bool, grads: dict):
        """grad:f; at the first compute, also adds f's weight gradients into ``grads`` (torch name ->)."""
        torch = self.torch
        f = name[len("grad:"):]
        layer = self.net.layers[f]
        g = None
        if f == self.net.output:  # mean cross-entropy over the batch, differentiated as plain training does
            logits = table[f].detach().requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(self.logits2d(logits), self.y)
            (g,) = torch.autograd.grad(loss, logits)
        for user in self.users[f]:
            for which, operand in enumerate(user.operands):
                if operand == f:
                    part = self._data_gradient(user, which, table)
                    # out of place: a part may be a view of grad:u, which stays in the table
                    g = part if g is None else g + part
        if g is None:
            g = torch.zeros(layer.shape, device=self.device)
        g = g.detach()
        if g._base is not None or not g.is_contiguous():  # its own tensor, as the plan counts it
            g = g.contiguous() if not g.is_contiguous() else g.clone()
        if layer.trainable and first:
            for pname, value in self._weight_gradients(layer, g, table).items():
                grads[pname] = value if pname not in grads else grads[pname].add_(value)
        return g

    def _data_gradient(self, user: Layer, which: int, table: dict):
        """d(loss)/d(the producer of operand ``which`` of ``user``), from grad:user."""
        torch = self.torch
        gu = table["grad:" + user.name]
        chain = user.operand_views[which]
        op = user.op
        if op in _LINEAR:
            with torch.enable_grad():
                p = gu.new_zeros(()).requires_grad_(True).expand(user.operand_shapes[which])
                (g,) = torch.autograd.grad(self._run(user, [self._view(p, chain)], first=False), p, gu)
            return g
        spec = registry.get(op)
        if op not in _EXPLICIT and spec is not None and spec.saves == "out" and \
                (spec.torch_backward is not None or spec.torch_backward_call is not None):
            with torch.no_grad():
                if spec.torch_backward is not None:
                    gv = spec.torch_backward(torch, gu, table[user.name])
                else:  # from the output and the traced call (elu's alpha, rsqrt or sqrt)
                    gv = spec.torch_backward_call(torch, gu, table[user.name], *self._call_arguments(user))
            return self._unview(user.operand_shapes[which], chain, gv) if chain else gv
        if op not in _EXPLICIT:
            return self._by_autograd(user, which, table, gu)
        if op == "add" and (len(user.operands) != 2 or user.origin.kwargs.get("alpha", 1) != 1
                            or tuple(self._viewed_shape(user, which, table)) != tuple(gu.shape)):
            return self._by_autograd(user, which, table, gu)  # a constant or a broadcast operand: linear
        m = self.modules.get(user.origin.target) if user.origin.op == "call_module" else None
        with torch.no_grad():
            if op in ("add", "copy"):
                shape = self._viewed_shape(user, which, table)
                gv = gu.reshape(shape)
            elif op == "conv2d":
                gv = torch.nn.grad.conv2d_input(self._viewed_shape(user, which, table), m.weight, gu, m.stride,
                                                m.padding, m.dilation, m.groups)
            elif op == "linear":
                gv = gu.matmul(m.weight)
            elif op == "global_avgpool":
                shape = self._viewed_shape(user, which, table)
                gv = (gu.reshape(shape[0], shape[1], 1, 1) / (shape[2] * shape[3])).expand(shape)
            else:  # matmul: reads the other operand
                other = self.operand(user, 1 - which, table)
                gv = gu.matmul(other.transpose(-1, -2)) if which == 0 else other.transpose(-1, -2).matmul(gu)
        return self._unview(user.operand_shapes[which], chain, gv) if chain else gv

    def _viewed_shape(self, user: Layer, which: int, table: dict):
        shape = user.operand_shapes[which]
        if not user.operand_views[which]:
            return tuple(shape)
        meta = self.torch.empty(shape, device="meta")  # a view's shape, without the producer's data
        return tuple(self._view(meta, user.operand_views[which]).shape)

    def _call_arguments(self, user: Layer) -> tuple[str, dict]:
        """(the traced call's name, its arguments): a module's attributes, a function's bound ones."""
        import inspect

        n = user.origin
        if n.op == "call_module":
            m = self.modules[n.target]
            return type(m).__name__.lower(), {k: v for k, v in vars(m).items() if not k.startswith("_")}
        args, kwargs = self._const(tuple(n.args[1:])), self._const(dict(n.kwargs))
        name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
        try:
            bound = inspect.signature(n.target).bind(None, *args, **kwargs).arguments
        except (TypeError, ValueError):  # a builtin without a signature, a method: what was spelled
            bound = dict(kwargs)
        return name.strip("_"), dict(bound)

    def _by_autograd(self, user: Layer, which: int, table: dict, gu):
        """Autograd on a re-run of ``user`` from what the graph keeps for the gradient: an operand it
        does not keep is one the operator is linear in (a - b, a * b's own factor, a / c's
        numerator), taken at a zero of its shape, which holds one number, not the tensor."""
        torch = self.torch
        kept = self.kept.get(user.operands[which], set())
        leaves = {}
        operands = []
        for i, name in enumerate(user.operands):
            value = table[name] if name in kept else gu.new_zeros(()).expand(user.operand_shapes[i])
            if name == user.operands[which] and i == which:
                leaf = value.detach().requires_grad_(True)
                leaves[i] = leaf
                operands.append(self._view(leaf, user.operand_views[i]))
            else:
                operands.append(self._view(value, user.operand_views[i]).detach())
        with torch.enable_grad():
            out = self._run(user, operands, first=False)
            (g,) = torch.autograd.grad(out, leaves[which], gu)
        return g

    def _weight_gradients(self, layer: Layer, g, table: dict) -> dict:
        torch = self.torch
        names = {role: p.torch_name for role, p in layer.params.items()}
        m = self.modules[layer.origin.target]
        x = self.operand(layer, 0, table)
        out = {}
        with torch.no_grad():
            if layer.op == "conv2d":
                out[names["weight"]] = torch.nn.grad.conv2d_weight(x, m.weight.shape, g, m.stride, m.padding,
                                                                   m.dilation, m.groups)
                if "bias" in names:
                    out[names["bias"]] = g.sum((0, 2, 3))
                return out
            if layer.op == "linear":
                g2 = g.reshape(-1, g.shape[-1])
                out[names["weight"]] = g2.t().matmul(x.reshape(-1, x.shape[-1]))
                if "bias" in names:
                    out[names["bias"]] = g2.sum(0)
                return out
        # norms and any other weighted module: autograd on a re-run from the inputs
        params = [self.params[n] for n in names.values()]
        with torch.enable_grad():
            y = self._run(layer, [x.detach()], first=False)
            values = torch.autograd.grad(y, params, g)
        return {n: v for n, v in zip(names.values(), values)}

