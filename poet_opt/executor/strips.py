"""What each node of a strip graph (poet_opt.model.strips) computes, in PyTorch, on strip tensors.

``replay`` runs a strip graph's nodes once each, in the graph's order, every node reading only the
tensors its ``deps`` name (a node that needs more raises KeyError: the graph would be wrong), with
plain torch operations: convolutions on the input rows a strip reads, padded with zeros (or -inf
for max pooling) where the rows run past the tensor; batch norm from the chained statistics; data
gradients gathered from the output-gradient strips whose windows touch a strip's rows; weight
gradients accumulated strip by strip; the SGD update applied in place where the graph puts it.
It keeps every tensor (no RAM budget): it checks the graph's maths, not a schedule. The
reference it is compared with is torch autograd on the unsplit network (tests/test_strips.py).

Layers are the zoo's forward operators as ``graph.meta["strips"].layers`` records them; their
parameters are given per layer: conv ``weight`` (and ``bias``), batch norm ``weight`` and ``bias``
(gamma, beta), linear ``weight`` and ``bias``, in PyTorch's shapes; a weight slice ``L#j`` takes
its rows of ``L``'s tensors.

Batch norm's running statistics (``running``: layer -> :class:`Running`) move as torch's training
mode moves them, once per replay, from the whole tensor's batch statistics: the end of the
statistics chain over a layer's strips, or the one strip's own. A replay stands for one step, so
a recompute of either finds the layer already moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from poet_opt.model import ops as registry
from poet_opt.model.strips import ELEMENTWISE
from poet_opt.model.tiling_records import touching, window_rows
from poet_opt.schedule.walk import walk

EPS = 1e-5  # batch norm's where the caller names none: torch.nn.BatchNorm2d's default


@dataclass
class Running:
    """One batch norm's running statistics, moved in place, and the module's momentum."""
    mean: Any
    var: Any
    momentum: float = 0.1

    def move(self, count: int, mean, m2) -> None:
        """torch's update from a batch of ``count`` values per channel with ``mean`` and summed
        squared deviations ``m2``: the running variance takes the unbiased batch variance."""
        m = self.momentum
        self.mean.mul_(1 - m).add_(m * mean.detach())
        self.var.mul_(1 - m).add_(m * m2.detach() / max(count - 1, 1))


def replay(graph, params: dict, x, y, lr: float, running: dict | None = None, eps: dict | None = None) -> dict:
    """Run ``graph`` on input ``x`` (N, C, H, W) and class labels ``y``; ``params``: layer -> {role:
    tensor}, updated in place by the graph's SGD updates; ``running``: layer -> Running, moved once;
    ``eps``: batch norm layer -> its module's eps (EPS for a layer not named). Returns {"loss",
    "values" (node -> tensor), "weight_grads" (layer -> {role: gradient}, as each update applied it)}."""
    return _Replay(graph, params, x, y, lr, running, eps).run()


def replayer(graph, params: dict, x, y, lr: float, running: dict | None = None, eps: dict | None = None):
    """The object ``replay`` runs, for an executor that walks a plan itself (executor/tiled.py):
    ``compute(node, records[node.name], env)`` runs one node on the tensors in ``env``, reading the
    weights of a layer from ``params`` (layer -> {role: tensor}) and updating them in place there.
    Make one per step: it moves each layer's ``running`` statistics at most once."""
    return _Replay(graph, params, x, y, lr, running, eps)


class _Replay:
    def __init__(self, graph, params, x, y, lr, running=None, eps=None):
        import torch

        self.t, self.graph, self.params, self.x, self.y, self.lr = torch, graph, params, x, y, lr
        self.eps = eps or {}
        self.running, self.moved = running or {}, set()
        self.tiling = tiling = graph.meta["strips"]
        self.layers, self.records, self.alias = tiling.layers, tiling.nodes, tiling.grad_alias
        self.values: dict = {}
        self.weight_grads: dict = {}
        # weight slice L#j -> the output channels [lo, hi) of L it computes
        self.channels = {name: lohi for slices in (graph.meta.get("tiles") or {}).values()
                         for name, lohi in slices.ranges().items()}

    def run(self) -> dict:
        for node in self.graph.nodes:
            env = {self.graph.nodes[d].name: self.values[self.graph.nodes[d].name] for d in node.deps}
            self.values[node.name] = self.compute(node, self.records[node.name], env)
        return {"loss": self.values["loss"], "values": self.values, "weight_grads": self.weight_grads}

    # -- strips ------------------------------------------------------------------------------------


    def rows_of(self, env, layer: str, lo: int, hi: int, prefix: str = ""):
        """Rows [lo, hi) of tensor ``layer`` (or of its gradient, prefix "grad:"), from the strips
        in ``env`` that hold them."""
        if prefix == "grad:" and layer in self.alias:  # a weight slice: its channels of the concat's gradient
            c0, c1 = self.channels[layer]
            return self.rows_of(env, self.alias[layer], lo, hi, prefix)[:, c0:c1]
        pieces = [env[self.tiling.strip_name(layer, j, prefix)][:, :, r0 - a:r1 - a]
                  for j, (a, _), (r0, r1) in self.tiling.pieces(layer, lo, hi)]
        return self.t.cat(pieces, dim=2)

    def whole(self, env, layer: str, prefix: str = ""):
        shape = self.layers[layer].shape
        if len(shape) != 3:
            return env[prefix + layer]
        return self.rows_of(env, layer, 0, shape[1], prefix)

    def weights(self, env, layer: str) -> dict:
        env[f"param:{layer}"]  # the weights a node reads are in its deps
        return self.params[layer]

    # -- nodes -------------------------------------------------------------------------------------

    def compute(self, node, rec, env):
        role = rec.role
        if role == "param":
            return None
        if role == "loss":
            logits = env[self.graph.nodes[node.deps[0]].name]
            return self.t.nn.functional.cross_entropy(logits, self.y)
        if role == "forward":
            return self.forward(rec.layer, rec.rows, env)
        if role == "bn_stats":
            xs = env[self.tiling.strip_name(self.layers[rec.layer].inputs[0], self.tiling.strip_index(rec.layer, rec.rows))]
            count = xs.numel() // xs.shape[1]
            mean = xs.mean(dim=(0, 2, 3))
            m2 = ((xs - mean[None, :, None, None]) ** 2).sum(dim=(0, 2, 3))
            prev = self._previous(env, "stats:", rec)
            if prev is None:
                return (count, mean, m2)
            n_a, mean_a, m2_a = prev  # Chan et al.: merge two partitions' means and squared deviations
            n = n_a + count
            delta = mean - mean_a
            out = (n, mean_a + delta * count / n, m2_a + m2 + delta ** 2 * n_a * count / n)
            if self.tiling.strip_index(rec.layer, rec.rows) == len(self.tiling.strips(rec.layer)) - 1:  # the chain's end: the whole tensor's
                self._move(rec.layer, *out)
            return out
        if role == "bn_gstats":
            layer = rec.layer
            j = self.tiling.strip_index(rec.layer, rec.rows)
            g = env[self.tiling.strip_name(layer, j, "grad:")]
            xhat = self._xhat(env, layer, env[self.tiling.strip_name(self.layers[layer].inputs[0], j)])
            sums = (g.sum(dim=(0, 2, 3)), (g * xhat).sum(dim=(0, 2, 3)))
            prev = self._previous(env, "gstats:", rec)
            return sums if prev is None else (prev[0] + sums[0], prev[1] + sums[1])
        if role == "grad":
            return self.gradient(rec, env)
        if role in ("wgrad", "update"):
            return self.weight_gradient(rec, env)
        raise ValueError(f"unknown role {role!r} of node {node.name}")


    def _previous(self, env, prefix, rec):
        j = self.tiling.strip_index(rec.layer, rec.rows)
        return env[self.tiling.strip_name(rec.layer, j - 1, prefix)] if j else None

    def _move(self, layer: str, count: int, mean, m2) -> None:
        if layer in self.running and layer not in self.moved:
            self.moved.add(layer)
            with self.t.no_grad():
                self.running[layer].move(count, mean, m2)

    def _stats(self, env, layer):
        n, mean, m2 = env[self.tiling.chain_end("stats:", layer)]
        return mean, m2 / n

    def _xhat(self, env, layer, xs):
        mean, var = self._stats(env, layer)
        return (xs - mean[None, :, None, None]) / self.t.sqrt(var + self._eps(layer))[None, :, None, None]

    def _eps(self, layer: str) -> float:
        return self.eps.get(layer, EPS)

    def _window_input(self, env, layer: dict, name_in: str, rows, prefix: str = "", fill: float = 0.0):
        """The input rows output rows [a, b) read, padded past the tensor with ``fill`` (and along W)."""
        p = layer.window[2]
        h = self.layers[name_in].shape[1]
        r0, r1 = window_rows(rows, layer.window)
        local = self.rows_of(env, name_in, max(0, r0), min(h, r1), prefix)
        pad = (p, p, max(0, -r0), max(0, r1 - h))
        return self.t.nn.functional.pad(local, pad, value=fill)

    def forward(self, name: str, rows, env):
        F = self.t.nn.functional
        layer = self.layers[name]
        op, inputs = layer.op, layer.inputs
        if op == "input":
            return self.x if rows is None else self.x[:, :, rows[0]:rows[1]]
        if rows is None:  # a whole tensor (global pooling, the linear head)
            xs = [self.whole(env, i) for i in inputs]
            if op == "avgpool":
                return xs[0].mean(dim=(2, 3))
            if op == "linear":
                w = self.weights(env, name)
                return F.linear(xs[0].flatten(1), w["weight"], w.get("bias"))
            if op == "embedding":  # a table of token ids, whole (a table is never in strips)
                return F.embedding(xs[0].long(), self.weights(env, name)["weight"])
            if op == "concat":  # weight slices: along their features
                return self.t.cat(xs, dim=self._features(name))
            return self._elementwise(op, xs, "whole")
        j = self.tiling.strip_index(name, rows)
        if op in ("conv2d", "maxpool", "avgpool"):
            k, s, _ = layer.window
            local = self._window_input(env, layer, inputs[0], rows, fill=-math.inf if op == "maxpool" else 0.0)
            if op == "maxpool":
                return F.max_pool2d(local, k, s)
            if op == "avgpool":
                return F.avg_pool2d(local, k, s)
            w = self.weights(env, name)
            return F.conv2d(local, w["weight"], w.get("bias"), stride=s, groups=layer.groups)
        xs = [env[self.tiling.strip_name(i, j)] for i in inputs]
        if op == "batchnorm":
            w = self.weights(env, name)
            if not self.tiling.striped(name):
                if name in self.running and name not in self.moved:
                    mean = xs[0].mean(dim=(0, 2, 3))
                    self._move(name, xs[0].numel() // xs[0].shape[1], mean,
                               ((xs[0] - mean[None, :, None, None]) ** 2).sum(dim=(0, 2, 3)))
                return F.batch_norm(xs[0], None, None, w["weight"], w["bias"], training=True, eps=self._eps(name))
            return self._xhat(env, name, xs[0]) * w["weight"][None, :, None, None] + w["bias"][None, :, None, None]
        return self._elementwise(op, xs, "strip")

    def _elementwise(self, op: str, xs, kind: str):
        """An elementwise operator or a join along channels (features, for the weight slices of a
        linear layer), by PyTorch's own function from the registry."""
        if op == "add":  # x + x records its input once: add has two operands
            return xs[0] + xs[-1]
        spec = registry.get(op)
        if spec is not None and op in ELEMENTWISE and spec.torch_forward is not None:  # relu, concat, ...
            return spec.torch_forward(self.t, *xs)
        raise ValueError(f"no {kind} kernel for {op}")

    # -- gradients ---------------------------------------------------------------------------------

    def gradient(self, rec, env):
        f, rows = rec.of, rec.rows
        shape = self.layers[f].shape
        j = self.tiling.strip_index(f, rows) if rows is not None else 0
        total = env[rec.prev] if rec.prev else 0
        if rec.logits:
            logits = env[f]
            onehot = self.t.nn.functional.one_hot(self.y, logits.shape[1]).to(logits.dtype)
            total = total + (self.t.softmax(logits, dim=1) - onehot) / logits.shape[0]
        for u in rec.terms:
            total = total + self.term(u, f, j, rows, shape, env)
        for u in rec.updates:
            self.apply(u, self.fused_weight_gradient(u, env))
        return total

    def term(self, u: str, f: str, j: int, rows, shape, env):
        F, t = self.t.nn.functional, self.t
        layer = self.layers[u]
        op = layer.op
        if len(layer.shape) != 3:  # a whole user: global average pooling or the linear head
            g = env[f"grad:{u}"]
            if op == "avgpool":
                full = (g / (shape[1] * shape[2]))[:, :, None, None].expand(-1, -1, shape[1], shape[2])
            elif op == "linear":
                full = (g @ self.weights(env, u)["weight"]).reshape(g.shape[0], *shape)
            else:  # an MLP's tensors: whole, as the strips' elementwise users below
                return self._elementwise_gradient(u, f, g, lambda: env[f], lambda: env[u])
            return full if rows is None else full[:, :, rows[0]:rows[1]]
        lo, hi = rows if rows is not None else (0, shape[1])
        if op in ("conv2d", "maxpool", "avgpool"):
            k, s, p = layer.window
            m0, m1 = touching((lo, hi), layer.window, layer.shape[1])
            out = t.zeros(self.x.shape[0], shape[0], hi - lo, shape[2], dtype=self.x.dtype)
            if m0 >= m1:
                return out
            g = self.rows_of(env, u, m0, m1, "grad:")
            r0, _ = window_rows((m0, m1), layer.window)
            if op == "conv2d":
                w = self.weights(env, u)["weight"]
                size = (g.shape[0], shape[0], (m1 - 1 - m0) * s + k, shape[2] + 2 * p)
                local = t.nn.grad.conv2d_input(size, w, g, stride=s, groups=layer.groups)
            else:  # pooling: the vector-Jacobian product of the local window, re-run on its input rows
                if op == "maxpool":  # where the maximum of every touched window is
                    xin = self._window_input(env, layer, f, (m0, m1), fill=-math.inf)
                else:  # average pooling is linear: its gradient reads no input (the graph keeps none)
                    xin = t.zeros(size_of_window(g, shape, layer.window, m0, m1), dtype=g.dtype)
                xin = xin.detach().requires_grad_(True)
                pooled = (F.max_pool2d if op == "maxpool" else F.avg_pool2d)(xin, k, s)
                (local,) = t.autograd.grad(pooled, xin, g)
            local = local[:, :, :, p:p + shape[2]]
            a, b = max(lo, r0), min(hi, r0 + local.shape[2])
            if a < b:
                out[:, :, a - lo:b - lo] = local[:, :, a - r0:b - r0]
            return out
        g = env[self.tiling.strip_name(u, j, "grad:")]
        if op != "batchnorm":
            return self._elementwise_gradient(u, f, g, lambda: env[self.tiling.strip_name(f, j)],
                                              lambda: env[self.tiling.strip_name(u, j)])
        w = self.weights(env, u)
        xs = env[self.tiling.strip_name(f, j)]
        if not self.tiling.striped(u):  # one strip: its own batch statistics
            mean, var = xs.mean(dim=(0, 2, 3)), xs.var(dim=(0, 2, 3), unbiased=False)
            xhat = (xs - mean[None, :, None, None]) / t.sqrt(var + self._eps(u))[None, :, None, None]
            n = xs.numel() // xs.shape[1]
            sums = (g.sum(dim=(0, 2, 3)), (g * xhat).sum(dim=(0, 2, 3)))
            rstd = 1 / t.sqrt(var + self._eps(u))
        else:
            _, var = self._stats(env, u)
            xhat = self._xhat(env, u, xs)
            n = self.x.shape[0] * layer.shape[1] * layer.shape[2]
            sums = env[self.tiling.chain_end("gstats:", u)]
            rstd = 1 / t.sqrt(var + self._eps(u))
        scale = (w["weight"] * rstd)[None, :, None, None]
        return scale * (g - sums[0][None, :, None, None] / n - xhat * sums[1][None, :, None, None] / n)

    def _elementwise_gradient(self, u: str, f: str, g, x, y):
        """The gradient an elementwise user ``u`` (or a join) passes to its input ``f``, from its own
        output gradient ``g``; ``x`` and ``y`` give u's input and output, called only where the
        registry says its backward reads them (the plan may have freed the others)."""
        layer = self.layers[u]
        op = layer.op
        spec = registry.get(op)
        if spec is not None and op in ELEMENTWISE and spec.arity == 1:
            return spec.torch_gradient(self.t, g, x=x() if spec.saves == "in" else None,
                                       y=y() if spec.saves == "out" else None)
        if op == "add":  # x + x (its input recorded once) passes the gradient on twice
            return g if len(layer.inputs) == 2 else 2 * g
        if op == "concat":
            c0, c1 = self.channels[f]
            return g.narrow(self._features(u), c0, c1 - c0)
        raise ValueError(f"no gradient for {op}")

    def _features(self, layer: str) -> int:
        """The axis of a tensor's features, the batch first: channels of (C, H, W) and a vector's
        features, the last of (tokens, features), as model/tiling.py slices them."""
        return 2 if len(self.layers[layer].shape) == 2 else 1

    def fused_weight_gradient(self, u: str, env) -> dict:
        """The weight gradient of layer u whose update a data-gradient node applies."""
        layer = self.layers[u]
        op = layer.op
        if op == "batchnorm" and self.tiling.striped(u):
            s0, s1 = env[self.tiling.chain_end("gstats:", u)]
            return {"weight": s1, "bias": s0}
        return self.strip_weight_gradient(u, None, env)

    def strip_weight_gradient(self, u: str, rows, env) -> dict:
        t = self.t
        layer = self.layers[u]
        op, (x,) = layer.op, layer.inputs
        shape = layer.shape
        if op == "linear":
            g, xs = env[f"grad:{u}"], self.whole(env, x).flatten(1)
            return {"weight": g.t() @ xs, "bias": g.sum(0)}
        if op == "embedding":  # each token's output gradient added into its row, in token order as torch does
            table, ids = self.params[u]["weight"], self.whole(env, x).long().flatten()
            g = env[f"grad:{u}"].reshape(-1, table.shape[1])
            return {"weight": t.zeros(table.shape, dtype=g.dtype).index_add_(0, ids, g)}
        lo, hi = rows if rows is not None else (0, shape[1])
        g = self.rows_of(env, u, lo, hi, "grad:")
        if op == "batchnorm":  # one strip: its own batch statistics
            xs = self.whole(env, x)
            mean, var = xs.mean(dim=(0, 2, 3)), xs.var(dim=(0, 2, 3), unbiased=False)
            xhat = (xs - mean[None, :, None, None]) / t.sqrt(var + self._eps(u))[None, :, None, None]
            return {"weight": (g * xhat).sum(dim=(0, 2, 3)), "bias": g.sum(dim=(0, 2, 3))}
        k, s, _ = layer.window
        local = self._window_input(env, layer, x, (lo, hi))
        w = self.params[u]
        out = {"weight": t.nn.grad.conv2d_weight(local, w["weight"].shape, g, stride=s, groups=layer.groups)}
        if "bias" in w:
            out["bias"] = g.sum(dim=(0, 2, 3))
        return out

    def weight_gradient(self, rec, env):
        u = rec.layer
        part = self.strip_weight_gradient(u, rec.rows, env)
        if rec.prev:
            part = {role: env[rec.prev][role] + v for role, v in part.items()}
        if rec.role == "update" or rec.update:
            self.apply(u, part)
            return None
        return part

    def apply(self, u: str, grads: dict) -> None:
        self.weight_grads[u] = grads
        with self.t.no_grad():
            for role, g in grads.items():
                self.params[u][role].sub_(self.lr * g)


def size_of_window(g, shape, window, m0: int, m1: int) -> tuple[int, ...]:
    """The padded input a window operator's output rows [m0, m1) read."""
    k, s, p = window
    return (g.shape[0], shape[0], (m1 - 1 - m0) * s + k, shape[2] + 2 * p)


def run_plan(graph, steps, params: dict, x, y, lr: float, running: dict | None = None,
             eps: dict | None = None) -> dict:
    """Execute a strip plan: ``steps`` are (op, node name) pairs (compute, page_out, page_in, free)
    of a schedule of ``graph``, walked as every backend walks them (schedule/walk.py: a step that
    breaks a replay rule, such as a compute whose input is not resident or that reads weights after
    their update, raises ScheduleInvalid). A page-out copies to a dict that stands for the storage,
    a page-in copies back, a free drops; a recompute runs the node again. An update applies SGD to
    ``params`` in place once, and ``running`` (layer -> Running) moves once, as one step does.
    ``eps`` as for :func:`replay`. Returns the loss,
    the weight gradients and the peak of the resident bytes as the graph sizes them."""
    return execute(_Replay(graph, params, x, y, lr, running, eps), graph, steps)


def execute(r, graph, steps) -> dict:
    """Run ``steps`` with ``r`` (a replay of strip or row nodes: ``compute``, ``records``,
    ``weight_grads``), as ``run_plan`` says, on the walk every backend follows (schedule/walk.py)."""
    by_name = {n.name: n.id for n in graph.nodes}
    nodes = graph.nodes
    resident: dict = {}
    storage: dict = {}
    live = peak = 0
    loss = None
    walked = walk([(op, by_name[name]) for op, name in steps], [n.deps for n in nodes], [n.updates for n in nodes],
                  [n.name for n in nodes])
    for _, op, k, _ in walked:
        node = nodes[k]
        if op == "compute":
            env = {nodes[d].name: resident[d] for d in node.deps}
            value = r.compute(node, r.records[node.name], env)
            if node.name == "loss" and loss is None:
                loss = value
        elif op == "page_out":
            storage[node.id] = _copied(resident[node.id])
            continue
        elif op == "page_in":
            value = _copied(storage[node.id])
        else:  # free
            del resident[node.id]
            live -= node.bytes
            continue
        live += node.bytes
        resident[node.id] = value
        peak = max(peak, live)
    return {"loss": loss, "weight_grads": r.weight_grads, "peak_bytes": peak}


def _copied(value):
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value.clone() if hasattr(value, "clone") else value
