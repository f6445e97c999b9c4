"""A plan with streamed weights, activation strips and weight slices, or row tiles of a transformer,
run in PyTorch step for step.

``TiledExecutor(network, schedule, lr=...)`` trains a network lowered with streamed weights
(``lower_network(..., weights="streamed", strips=..., tile_bytes=...)``, the graph `poet-opt solve`
plans for such a module) one step per call, following the plan's steps in order:

- the weights live on storage: every ``param:L`` node's tensors (a slice's rows of the torch
  parameters) are written to a file under the storage directory when the executor starts, and a
  compute of ``param:L`` reads them back into RAM (a recompute reads them again);
- every other compute runs the node as executor/strips.py says (executor/rows.py for a row graph,
  whose ``param:L#j.k`` tiles are cut from the layer's parameters), on the tensors the plan holds
  resident, its strips or row blocks and its slice or tile of weights; a node that updates weights does so in place, and
  the updated tensors are written back to their file at once, as the firmware does;
- ``page_out`` writes a tensor (or a node's statistics) to storage, ``page_in`` reads it back,
  ``free`` drops it, and freeing ``param:L`` leaves no copy of those weights in RAM.

The peak of live bytes is counted as the plan counts it, from the tensors in the executor's own
table after every compute and page-in; the storage traffic is what went through the files.
Batch norm's running statistics are no node of a strip graph: the executor keeps them in RAM
beside the plan (as the firmware keeps them in static RAM) and the strip replay moves them once a
step, as torch's training mode does, from the batch statistics it normalises with;
:meth:`TiledExecutor.running_statistics` reads them.
"""

from __future__ import annotations

import math
import time

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.executor.runner import StepStats, Storage, check_schedule
from poet_opt.model.batch import check_x
from poet_opt.model import ops as registry
from poet_opt.model.network import Network
from poet_opt.model.ops import support
from poet_opt.schedule.walk import walk_document

# The layers executor/strips.py replays (forward, data and weight gradient) besides the elementwise
# operators it runs from their registry entry. Anything else is refused before training, naming
# the node, rather than failing half way through a step.
STRIP_OPS = {"input", "conv2d", "maxpool", "avgpool", "global_avgpool", "batchnorm", "add", "concat", "linear",
             "embedding"}  # a table is whole in a strip graph: its tokens are not rows along H


def replays(op: str) -> bool:
    spec = registry.get(op)
    return op in STRIP_OPS or (spec is not None and support.runs(spec, "strips", "executor"))


def check_runnable(network: Network) -> None:
    """Refuse, before any solve, a streamed network with a layer the strip replay has no kernel for
    (the row replay runs every operator the row builder takes)."""
    if network.graph.meta.get("rows") is not None:
        return
    for name, info in network.graph.meta["strips"].layers.items():
        if not replays(info.op):
            raise PoetError(f"layer {name!r} ({info.op}) has no strip kernel in the PyTorch executor, which runs "
                            "streamed weights through them; with --weights resident it runs whole layers, if they "
                            "fit (poet-opt emulate trains the streamed plan in firmware)", field="--weights")


class TiledExecutor:
    """One training step per call, as ``schedule`` says: ``loss = step(x, y)``, with plain SGD at
    ``lr``. ``storage``: the directory the weights and paged tensors live in (default: the system's
    temporary directory; removed by :meth:`close`). Runs on the CPU. After each call, ``last``
    holds its StepStats; :meth:`weights` reads the trained weights back from storage."""

    def __init__(self, network: Network, schedule, *, lr: float, storage=None):
        import torch

        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise PoetError(f"expected a positive finite learning rate, got {lr!r}", field="--lr")
        graph = network.graph
        self.rows = graph.meta.get("rows") is not None
        if graph.meta.get("strips") is None and not self.rows:
            raise PoetError("internal: the tiled executor needs a network lowered with strips (strips=1 for none) "
                            "or row tiles")
        self.doc = schedule.to_dict() if hasattr(schedule, "to_dict") else schedule
        check_schedule(network, self.doc)
        check_runnable(network)
        self.network, self.lr, self.device = network, lr, torch.device("cpu")
        self.by_name = {n.name: n for n in graph.nodes}
        # the document's node ids -> the graph's nodes (the document numbers them itself)
        self.graph_nodes = [self.by_name[n["name"]] for n in self.doc["graph"]["nodes"]]
        self.steps = [(s["op"], self.graph_nodes[int(s["node"])]) for s in self.doc["steps"]]
        self.store = Storage(storage)  # the weights
        self.pages = Storage(storage)  # paged tensors, in a folder of their own: node ids would collide
        self.roles: dict[str, list[tuple[str, tuple[int, ...]]]] = {}  # param node -> its tensors
        try:
            for n in graph.nodes:
                if n.op == "param":
                    self._store_initial(n)
        except BaseException:
            self.close()
            raise
        self.running = {} if self.rows else running_statistics_of(network)
        # each batch norm's own eps: the strip replay's default is torch's, and a module may differ
        self.eps = {name: float(layer.attrs["eps"]) for name, layer in network.layers.items() if "eps" in layer.attrs}
        self.last: StepStats | None = None

    def _initial(self, node) -> dict:
        """role -> initial value (numpy) of the weights a ``param:`` node holds."""
        if not self.rows:
            return {role: p.value for role, p in self.network.layers[node.name[len("param:"):]].params.items()}
        import torch

        from poet_opt.executor.rows import replayer

        whole = {name: {role: torch.from_numpy(p.value) for role, p in layer.params.items()}
                 for name, layer in self.network.layers.items() if layer.params}
        r = replayer(self.network.graph, whole, None, None, self.lr)
        return {role: t.numpy() for role, t in r.compute(node, r.records[node.name], {}).items()}

    def _store_initial(self, node) -> None:
        import torch

        values = self._initial(node)
        self.roles[node.name] = [(role, tuple(v.shape)) for role, v in values.items()]
        flat = np.concatenate([v.ravel() for v in values.values()]).astype(np.float32)
        if flat.nbytes != node.bytes:
            raise PoetError(f"internal: {node.name} holds {node.bytes} B in the graph, {flat.nbytes} B of weights")
        self.store.write(node.id, torch.from_numpy(flat))
        self.store.bytes_written = 0  # putting the weights on storage is setup, not a step's traffic

    # -- plan figures ------------------------------------------------------------------------------

    def planned_traffic(self) -> tuple[int, int]:
        """Bytes the plan writes to and reads from storage in one step: page-outs and weight
        write-backs; page-ins and weight reads (the input comes from the batch, not the storage)."""
        out = back = 0
        done = set()
        for op, n in self.steps:
            if op == "page_out":
                out += n.bytes
            elif op == "page_in" or op == "compute" and n.op == "param":
                back += n.bytes
            elif op == "compute" and n.updates and n.id not in done:
                out += sum(self.network.graph.nodes[p].bytes for p in n.updates)
                done.add(n.id)
        return out, back

    @property
    def planned_peak_bytes(self) -> int:
        return int(self.doc["totals"]["peak_ram_bytes"])

    # -- the step ----------------------------------------------------------------------------------

    def _placeholders(self, layer: str) -> dict:
        """A layer's weights while they are not in RAM: tensors on torch's meta device carry their
        shapes (a weight gradient asks for them) and no data, so a kernel that would compute with
        weights the plan has not read fails instead of reading a stale copy."""
        import torch

        return {role: torch.empty(shape, device="meta") for role, shape in self.roles[f"param:{layer}"]}

    def _read_weights(self, node) -> dict:
        flat = self.store.read(node.id, (node.bytes // 4,), self.device)
        out, at = {}, 0
        for role, shape in self.roles[node.name]:
            count = math.prod(shape)
            out[role] = flat[at:at + count].reshape(shape)
            at += count
        return out

    def __call__(self, x, y) -> float:
        x, y = self._check_batch(x, y)
        graph = self.network.graph
        if self.rows:  # a row node reads its tile's weights from the param node's value, never from params
            from poet_opt.executor.rows import replayer

            params: dict = {}
            r = replayer(graph, params, x, y, self.lr)
        else:
            from poet_opt.executor.strips import replayer

            params = {name[len("param:"):]: self._placeholders(name[len("param:"):]) for name in self.roles}
            # one per step: the running statistics move once in it
            r = replayer(graph, params, x, y, self.lr, self.running, self.eps)
        table: dict = {}
        layouts: dict = {}
        live = peak = 0
        w0, r0 = self.store.bytes_written + self.pages.bytes_written, self.store.bytes_read + self.pages.bytes_read
        counts = {"compute": 0, "page_out": 0, "page_in": 0}
        done: list[tuple[str, int]] = []
        loss = math.nan
        start = time.perf_counter()
        # no torch.no_grad(): the replay differentiates a max pooling window with autograd
        try:
            for _, op, k, _ in walk_document(self.doc):
                node = self.graph_nodes[k]
                name = node.name
                done.append((op, node.id))
                if op == "free":
                    live -= nbytes(table.pop(name))
                    if node.op == "param" and not self.rows:
                        params[name[len("param:"):]] = self._placeholders(name[len("param:"):])
                    continue
                if op == "page_out":
                    flat, layouts[node.id] = _flatten(table[name])
                    self.pages.write(node.id, flat)
                    counts[op] += 1
                    continue
                if op == "page_in":
                    value = _unflatten(self.pages.read(node.id, (node.bytes // 4,), self.device), layouts[node.id])
                elif node.op == "param":
                    value = self._read_weights(node)
                    if not self.rows:
                        params[name[len("param:"):]] = value
                else:
                    env = {graph.nodes[d].name: table[graph.nodes[d].name] for d in node.deps}
                    value = r.compute(node, r.records[name], env)
                    r.weight_grads.clear()  # the replay's record of each update: not kept in a run
                    for p in node.updates:  # updated in place: written back as the firmware does
                        flat, _ = _flatten(table[graph.nodes[p].name])
                        self.store.write(p, flat)
                    if name == "loss":
                        loss = float(value)
                counts[op] += 1
                if name in table:  # a recompute or page-in of a tensor still held replaces it
                    live -= nbytes(table[name])
                table[name] = value
                live += nbytes(value)
                peak = max(peak, live)  # a compute holds its inputs and its output at once
        finally:
            table.clear()
        wall = time.perf_counter() - start
        self.last = StepStats(loss, peak, self.store.bytes_written + self.pages.bytes_written - w0,
                              self.store.bytes_read + self.pages.bytes_read - r0, wall, counts["compute"],
                              counts["page_out"], counts["page_in"], tuple(done))
        return loss

    def _check_batch(self, x, y):
        import torch

        x, y = torch.as_tensor(x), torch.as_tensor(y)
        want = tuple(self.network.input_shape)
        if tuple(x.shape) != want:
            raise PoetError(f"x has shape {','.join(map(str, x.shape))} ({x.dtype}), the schedule is for "
                            f"{','.join(map(str, want))}", field="--data")
        x = torch.as_tensor(check_x(x.numpy(), self.network.vocabulary))
        classes = self.network.layers[self.network.output].elements // want[0]
        if y.dim() != 1 or y.shape[0] != want[0] or y.dtype not in (torch.int64, torch.int32):
            raise PoetError(f"y must hold {want[0]} integer class labels, got shape {tuple(y.shape)} ({y.dtype})",
                            field="--data")
        if bool((y < 0).any()) or bool((y >= classes).any()):
            raise PoetError(f"labels must lie in [0, {classes}) for this model's {classes} outputs", field="--data")
        return x, y.to(torch.int64)

    def weights(self) -> dict[str, np.ndarray]:
        """torch name -> trained value (float32, PyTorch's shape) of the trainable parameters, read
        back from storage and put together from the slices."""
        if self.rows:
            return self._row_weights()
        parts: dict = {}
        for n in self.network.graph.nodes:
            if n.op != "param":
                continue
            layer = self.network.layers[n.name[len("param:"):]]
            if not layer.trainable:
                continue
            value = self._read_weights(n)
            for role, p in layer.params.items():
                parts.setdefault(p.torch_name, []).append((p, value[role].numpy()))
        self.store.bytes_read = 0
        return self.network.assemble(parts)

    def running_statistics(self) -> dict[str, np.ndarray]:
        """torch buffer name -> value of the batch norms' running means and variances, as the steps
        so far moved them (``state_dict`` names, as `poet-opt emulate --weights-out` writes them)."""
        names = {name: {role: b.torch_name for role, b in self.network.layers[name].buffers.items()}
                 for name in self.running}
        return {**{names[n]["running_mean"]: r.mean.numpy().copy() for n, r in self.running.items()},
                **{names[n]["running_var"]: r.var.numpy().copy() for n, r in self.running.items()}}

    def _row_weights(self) -> dict[str, np.ndarray]:
        """The trained layers' parameters put together from their ``param:L#j.k`` tiles, over their
        initial values: a position table's tiles past the sequence are no node, never read nor changed."""
        from poet_opt.executor.rows import replayer

        r = replayer(self.network.graph, {}, None, None, self.lr)
        out: dict[str, np.ndarray] = {}
        for n in self.network.graph.nodes:
            if n.op != "param":
                continue
            name, tile = n.name[len("param:"):].split("#")
            layer = self.network.layers[name]
            if not layer.trainable:
                continue
            value = self._read_weights(n)
            for role, where in r.tile_where(name, tuple(int(t) for t in tile.split("."))).items():
                p = layer.params[role]
                whole = out.setdefault(p.torch_name, p.value.astype(np.float32, copy=True))
                whole[where] = value[role].numpy()
        self.store.bytes_read = 0
        return out

    def close(self) -> None:
        self.store.close()
        self.pages.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def running_statistics_of(network: Network) -> dict:
    """layer -> Running: a copy of each batch norm's running statistics that tracks them (the
    module's own stay as they were, as its parameters do), with the module's momentum."""
    import torch

    from poet_opt.executor.strips import Running

    return {name: Running(torch.from_numpy(layer.buffers["running_mean"].value.astype(np.float32)),
                          torch.from_numpy(layer.buffers["running_var"].value.astype(np.float32)),
                          float(layer.attrs.get("momentum", 0.1)))
            for name, layer in network.layers.items()
            if layer.op == "batchnorm" and {"running_mean", "running_var"} <= set(layer.buffers)}


def nbytes(value) -> int:
    """The bytes a node's value holds: a tensor, a layer's weights (a dict), batch norm's chained
    statistics (a tuple with a count), nothing (an update that returns no tensor)."""
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if hasattr(value, "element_size"):
        return value.numel() * value.element_size()
    return 0


def _flatten(value):
    """(one float32 tensor, layout) of a node's value, so that it pages as one file (token ids,
    int32, as the float32 of the same bits)."""
    import torch

    tensors: list = []

    def walk(v):
        if isinstance(v, (tuple, list)):
            return ("seq", [walk(e) for e in v])
        if isinstance(v, dict):
            return ("map", {k: walk(e) for k, e in v.items()})
        if hasattr(v, "element_size"):
            flat = v.reshape(-1)
            tensors.append(flat if flat.dtype == torch.float32 else flat.contiguous().view(torch.float32))
            return ("tensor", (tuple(v.shape), v.dtype))
        return ("value", v)

    layout = walk(value)
    flat = torch.cat(tensors) if tensors else torch.zeros(0)
    return flat, layout


def _unflatten(flat, layout):
    at = 0

    def build(node):
        nonlocal at
        kind, body = node
        if kind == "seq":
            return tuple(build(e) for e in body)
        if kind == "map":
            return {k: build(e) for k, e in body.items()}
        if kind == "tensor":
            shape, dtype = body
            count = math.prod(shape)
            out = flat[at:at + count].reshape(shape)
            at += count
            return out if dtype == out.dtype else out.view(dtype)
        return body

    return build(layout)
