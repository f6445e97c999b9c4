"""A training step in PyTorch that follows a schedule exactly.

``ScheduleExecutor(network, schedule, lr=...)`` walks the schedule's steps in order on every call:
``compute`` runs a node (poet_opt.executor.kernels) and keeps its output, ``page_out`` writes a
resident tensor to a file in the storage directory, ``page_in`` reads it back, ``free`` drops it.
Weight gradients accumulate during the backward nodes; the SGD update (or the given optimizer's
step) comes after the last step.

What it measures, per step: the peak of the bytes of the tensors in its own table (the node outputs
the schedule holds resident, counted after each compute and page-in, as the plan counts them; not
the allocator, whose caches and the kernels' scratch space are PyTorch's), the bytes written to and
read from storage, and the wall time.
"""

from __future__ import annotations

import errno
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.executor.kernels import Kernels
from poet_opt.model.batch import check_labels, check_x
from poet_opt.model.network import Network
from poet_opt.schedule.walk import walk_document

STORAGE_FIELD = "--storage"
SCHEDULE_FIELD = "--schedule"


@dataclass
class StepStats:
    loss: float
    peak_live_bytes: int
    storage_bytes_written: int
    storage_bytes_read: int
    wall_s: float
    computes: int
    page_outs: int
    page_ins: int
    # the (op, node id) steps as this call performed them, in order: what `run --schedule` is held to
    executed: tuple = ()


class Storage:
    """Paged tensors as raw files in a private folder under ``root`` (removed by :meth:`close`)."""

    def __init__(self, root=None):
        root = Path(root) if root is not None else Path(tempfile.gettempdir())
        # the folders made here, deepest first: removed again by close, so that a run (or a
        # failed one) leaves the file system as it found it
        self._made = []
        for folder in [root, *root.parents]:
            if folder.exists() or folder.is_symlink():
                break
            self._made.append(folder)
        try:
            if root.exists() and not root.is_dir():
                raise PoetError("is a file, not a directory", source=str(root), field=STORAGE_FIELD)
            root.mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix="poet-run-", dir=root))
        except OSError as exc:
            self._remove_made()
            raise PoetError(f"cannot write in the storage directory: {exc.strerror}", source=str(root),
                            field=STORAGE_FIELD) from None
        self.root = root
        self.bytes_written = self.bytes_read = 0

    def _path(self, node: int) -> Path:
        return self.dir / f"node-{node}.bin"

    def write(self, node: int, tensor) -> None:
        data = tensor.detach().to("cpu").contiguous().numpy()
        try:
            with open(self._path(node), "wb") as fh:
                fh.write(memoryview(data).cast("B"))
        except OSError as exc:
            what = "the storage directory is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else \
                f"cannot write to the storage directory: {exc.strerror}"
            raise PoetError(what, source=str(self.root), field=STORAGE_FIELD) from None
        self.bytes_written += data.nbytes

    def read(self, node: int, shape, device):
        import torch

        count = math.prod(shape)
        try:
            data = np.fromfile(self._path(node), dtype=np.float32)
        except OSError as exc:
            raise PoetError(f"cannot read back a paged tensor: {exc.strerror}", source=str(self.root),
                            field=STORAGE_FIELD) from None
        if data.size != count:
            raise PoetError(f"a paged tensor came back with {data.size} values instead of {count}",
                            source=str(self.root), field=STORAGE_FIELD)
        self.bytes_read += data.nbytes
        return torch.from_numpy(data).reshape(shape).to(device)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._remove_made()

    def _remove_made(self) -> None:
        for folder in self._made:
            try:
                folder.rmdir()  # only while empty: whatever else came to be there stays
            except OSError:
                break
        self._made = []


def _document(schedule) -> dict:
    return schedule.to_dict() if hasattr(schedule, "to_dict") else schedule


def check_schedule(network: Network, doc: dict) -> None:
    """A schedule is for this network when it has the same nodes (by name), sizes, dependencies and
    trainable layers. It must validate first; a mismatch is one line naming ``--schedule`` and what
    differs: the model, the input shape, or the trainable set (each changes the plan's nodes)."""
    from poet_opt.schedule.validator import validate

    if not isinstance(doc, dict) or doc.get("format") != "poet-opt/schedule@1":
        raise PoetError("not a poet-opt/schedule@1 document", field=SCHEDULE_FIELD)
    validate(doc)
    nodes = doc["graph"]["nodes"]
    from poet_opt.model.rows import row_node
    from poet_opt.model.strips import refuse_strips

    rows = network is not None and network.graph.meta.get("rows") is not None
    tiled = row_node(nodes)
    if tiled is not None and not rows:  # row plans run in executor/tiled.py, on a network lowered in row tiles
        raise PoetError(f"the plan tiles a transformer by token rows (node {tiled}); the PyTorch executor runs it "
                        "only on a torch transformer lowered in the same row tiles (the plan's --strips)",
                        field=SCHEDULE_FIELD)
    striped = network is not None and network.graph.meta.get("strips") is not None
    if not striped:  # strip plans run in executor/tiled.py, on a network lowered with strips
        refuse_strips(nodes, "the PyTorch executor", SCHEDULE_FIELD)
    streamed = any(n.get("op") == "param" for n in nodes)
    if streamed and not network.graph.streams_weights:
        raise PoetError("the plan streams its weights from storage (--weights streamed); this network keeps them "
                        "in RAM: give `run` the plan's --weights streamed", field=SCHEDULE_FIELD)
    updates = {str(n.get("op", "")) for n in nodes if str(n.get("op", "")).endswith("_update")}
    if streamed and updates - {"sgd_update"}:  # streamed plans fuse the update into the backward nodes
        raise PoetError(f"the plan updates streamed weights with {sorted(updates - {'sgd_update'})[0]}; the PyTorch "
                        "executor runs plain SGD on them: solve it with --optimizer none", field=SCHEDULE_FIELD)
    if not streamed and updates:
        raise PoetError("the plan has the weight update as graph nodes (--optimizer); the PyTorch executor updates "
                        "the weights after the step itself: solve it with --optimizer none", field=SCHEDULE_FIELD)
    check_same_graph(network, doc)


def check_same_graph(network: Network, doc: dict) -> None:
    """The plan's nodes are ``network``'s: the same forward layers, input shape, trainable set, then
    every node's name, kind, bytes and inputs; else one line naming ``--schedule`` and what differs."""
    nodes = doc["graph"]["nodes"]
    graph = network.graph
    # a streamed plan's nodes are its slices and strips too: the options that cut them change them
    streamed = graph.streams_weights or any(n.get("op") == "param" for n in nodes)
    hint = " (or solved with other --weights, --weight-tile or --strips)" if streamed else ""
    # the forward nodes first: a frozen layer has no gradient node, so the trainable set changes the
    # backward nodes and would otherwise read as another model
    theirs = {n["name"]: n for n in nodes if n["kind"] == "forward"}
    mine = {n.name: n for n in graph.nodes if n.kind == "forward"}
    if set(theirs) != set(mine):
        missing = sorted(set(mine) - set(theirs))[:3] or sorted(set(theirs) - set(mine))[:3]
        raise PoetError(f"the plan is for another model{hint}: its {len(theirs)} forward nodes are not this model's "
                        f"{len(mine)} (e.g. {', '.join(missing)})", field=SCHEDULE_FIELD)
    planned = doc["graph"].get("input_shape")
    shape = [int(d) for d in network.input_shape]
    if planned is not None and list(planned) != shape:
        raise PoetError(f"the plan is for another input shape: {_shape(planned)}, not --input-shape {_shape(shape)}",
                        field=SCHEDULE_FIELD)
    resized = [name for name in mine if int(theirs[name]["bytes"]) != mine[name].bytes]
    if resized:  # an older file without input_shape
        first = resized[0]
        raise PoetError(f"the plan is for another model or input shape: layer {first!r} holds "
                        f"{int(theirs[first]['bytes']):,} B there, {mine[first].bytes:,} B here (--input-shape "
                        f"{_shape(shape)})", field=SCHEDULE_FIELD)
    trained = [name for name in mine if theirs[name].get("trainable")]  # both in the model's layer order
    training = [name for name, n in mine.items() if n.trainable]
    if trained != training:
        raise PoetError(f"the plan is for another trainable set: it trains {_names(trained)}, --trainable "
                        f"{graph.meta.get('trainable', 'all')} trains {_names(training)}", field=SCHEDULE_FIELD)
    every = {n.name: n for n in graph.nodes}
    names = [n["name"] for n in nodes]
    if set(names) != set(every) or len(names) != len(every):
        missing = sorted(set(every) - set(names))[:3] or sorted(set(names) - set(every))[:3]
        raise PoetError(f"the plan is for another model{hint}: its {len(names)} nodes are not this model's "
                        f"{len(every)} (e.g. {', '.join(missing)})", field=SCHEDULE_FIELD)
    for n in nodes:
        m = every[n["name"]]
        deps = sorted(names[d] for d in n["deps"])
        if n["kind"] != m.kind or int(n["bytes"]) != m.bytes or deps != sorted(graph.nodes[d].name for d in m.deps):
            raise PoetError(f"the plan is for another model: node {n['name']!r} differs (kind, bytes or inputs)",
                            field=SCHEDULE_FIELD)


def _shape(dims) -> str:
    return ",".join(str(d) for d in dims)


def _names(names: list[str]) -> str:
    if not names:
        return "no layer"
    shown = ", ".join(names[:4])
    return f"{len(names)} layers ({shown}{', ...' if len(names) > 4 else ''})" if len(names) > 1 else shown


class ScheduleExecutor:
    """One training step per call, as ``schedule`` says: ``loss = step(x, y)``.

    ``network`` comes from ``lower_network(module, shape, views=True)``; the module's own parameters
    are trained in place. ``lr`` is plain SGD's learning rate, or give a torch ``optimizer`` over the
    module's parameters (the executor fills ``.grad``, then calls its ``step()``). ``storage`` is the
    directory paged tensors go to (default: the system's temporary directory); ``device`` a torch
    device (default: CUDA when available, else CPU). After each call, ``last`` holds its StepStats."""

    def __init__(self, network: Network, schedule, *, lr: float | None = None, optimizer=None, storage=None,
                 device=None):
        import torch

        if (lr is None) == (optimizer is None):
            raise PoetError("give a learning rate or an optimizer, not both or neither", field="--lr")
        if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise PoetError(f"expected a positive finite learning rate, got {lr!r}", field="--lr")
        if network.graph.streams_weights:
            raise PoetError("internal: a network with streamed weights runs in executor/tiled.py's TiledExecutor")
        self.doc = _document(schedule)
        check_schedule(network, self.doc)
        self.network, self.lr, self.optimizer = network, lr, optimizer
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        network.module.to(self.device)
        network.module.train()
        self.kernels = Kernels(network, self.device)
        self.nodes = self.doc["graph"]["nodes"]
        self.steps = [(s["op"], int(s["node"])) for s in self.doc["steps"]]
        self.shapes = {n.name: layer.shape for n in network.graph.nodes
                       for layer in [network.layers.get(n.name)] if layer is not None}
        for n in self.nodes:  # a gradient has its node's shape; the loss one value per sample
            if n["kind"] == "backward":
                self.shapes[n["name"]] = network.layers[n["name"][len("grad:"):]].shape
            elif n["kind"] == "loss":
                self.shapes[n["name"]] = (network.input_shape[0],)
        paged = any(op in ("page_out", "page_in") for op, _ in self.steps)
        self.storage = Storage(storage) if paged else None
        self.last: StepStats | None = None

    # -- plan figures ------------------------------------------------------------------------------

    def planned_traffic(self) -> tuple[int, int]:
        """Bytes the plan writes to and reads from storage in one step."""
        out = sum(int(self.nodes[n]["bytes"]) for op, n in self.steps if op == "page_out")
        back = sum(int(self.nodes[n]["bytes"]) for op, n in self.steps if op == "page_in")
        return out, back

    @property
    def planned_peak_bytes(self) -> int:
        return int(self.doc["totals"]["peak_ram_bytes"])

    # -- the step ----------------------------------------------------------------------------------

    def _check_batch(self, x, y):
        import torch

        x = torch.as_tensor(x)
        want = tuple(self.network.input_shape)
        if tuple(x.shape) != want:
            raise PoetError(f"x has shape {','.join(map(str, x.shape))} ({x.dtype}), the schedule is for "
                            f"{','.join(map(str, want))}", field="--data")
        x = torch.as_tensor(check_x(x.cpu().numpy(), self.network.vocabulary))
        classes = self.network.layers[self.network.output].elements // want[0]
        # emulate's rule (any integer type); torch has no uint16-64 arithmetic to check them with
        y = check_labels(y.cpu().numpy() if isinstance(y, torch.Tensor) else y, classes)
        if y.shape[0] != want[0]:
            raise PoetError(f"y must hold {want[0]} class labels, one per sample, got {y.shape[0]}", field="--data")
        return x.to(self.device), torch.as_tensor(y).to(self.device)

    def __call__(self, x, y) -> float:
        import torch

        k = self.kernels
        k.x, k.y = self._check_batch(x, y)
        table: dict = {}
        grads: dict = {}
        live = peak = 0
        written0 = self.storage.bytes_written if self.storage else 0
        read0 = self.storage.bytes_read if self.storage else 0
        loss = math.nan
        counts = {"compute": 0, "page_out": 0, "page_in": 0}
        dtypes: dict = {}
        done: list[tuple[str, int]] = []
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        try:
            for _, op, node, first in walk_document(self.doc):
                info = self.nodes[node]
                name = info["name"]
                if op == "free":
                    live -= _nbytes(table.pop(name))
                    done.append((op, node))
                    continue
                if op == "page_out":
                    self.storage.write(node, table[name])
                    dtypes[node] = table[name].dtype  # token ids (int32) come back as their own bits
                    counts[op] += 1
                    done.append((op, node))
                    continue
                if op == "page_in":
                    t = self.storage.read(node, self.shapes[name], self.device)
                    if dtypes.get(node, t.dtype) != t.dtype:
                        t = t.view(dtypes[node])
                else:
                    if info["kind"] == "forward":
                        t = k.forward(name, table, first=first)
                    elif info["kind"] == "loss":
                        t = k.loss(table)
                        if first:
                            loss = float(t.mean())
                    else:
                        t = k.backward(name, table, first=first, grads=grads)
                counts[op] += 1
                done.append((op, node))
                table[name] = t
                live += _nbytes(t)
                peak = max(peak, live)  # a compute holds its inputs and its output at once
            table.clear()
            self._update(grads)
            sync()
        finally:
            table.clear()
        wall = time.perf_counter() - start
        self.last = StepStats(loss, peak, (self.storage.bytes_written - written0) if self.storage else 0,
                              (self.storage.bytes_read - read0) if self.storage else 0, wall, counts["compute"],
                              counts["page_out"], counts["page_in"], tuple(done))
        return loss

    def _update(self, grads: dict) -> None:
        import torch

        params = self.kernels.params
        if self.optimizer is not None:
            for name, p in params.items():
                p.grad = grads.get(name)
            self.optimizer.step()
            return
        with torch.no_grad():
            for name, g in grads.items():
                params[name].add_(g, alpha=-self.lr)  # torch.optim.SGD's update, to the bit

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _nbytes(t) -> int:
    return t.numel() * t.element_size()

