"""`poet-opt measure`: time every node of a torch module's training graph on this machine.

Each node runs as the executor runs it (poet_opt.executor.kernels): a forward node its layer, a
``grad:f`` node its data gradients and, for a trainable f, its weight gradients. All tensors of plain
training are computed once and kept; then each node runs ``warmup`` times untimed (caches, lazy
initialisation, the allocator's first requests) and ``repeat`` times timed. The median is the cost;
the interquartile range says how steady the machine was. The file written is the measured-costs
file `--costs` reads (poet_opt.model.measured_costs): ``name,time_s,energy_j``, energy being the
time at the given average power, left empty without one (the solver then costs it at the
profile's active power).
"""

from __future__ import annotations

import io
import math
import statistics
import time
from dataclasses import dataclass

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.executor.kernels import Kernels
from poet_opt.model.network import Network


@dataclass(frozen=True)
class NodeTiming:
    name: str
    kind: str  # forward, loss, backward
    times_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def spread_s(self) -> float:
        """Interquartile range of the timed runs (0 for fewer than two)."""
        if len(self.times_s) < 2:
            return 0.0
        q = statistics.quantiles(self.times_s, n=4, method="inclusive")
        return q[2] - q[0]


def _positive(value, field: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise PoetError(f"expected a whole number >= {least}, got {value!r}", field=field)
    return value


def measure_costs(network: Network, *, warmup: int = 2, repeat: int = 5, torch_device=None,
                  on_node=None) -> list[NodeTiming]:
    """Times of every node of ``network.graph`` (in graph order). ``on_node(name)`` is called after
    each node, for a progress bar."""
    import torch

    warmup = _positive(warmup, "--warmup", 0)
    repeat = _positive(repeat, "--repeat", 1)
    device = torch.device(torch_device if torch_device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    module = network.module.to(device)
    module.train()
    kernels = Kernels(network, device)
    shape = network.input_shape
    # a fixed random batch: the kernels' times do not depend on the values (no data-dependent branches)
    rng = np.random.default_rng(0)
    kernels.x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device)
    kernels.y = torch.zeros(shape[0], dtype=torch.int64, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    nodes = network.graph.nodes
    table: dict = {}

    def run(node):
        # first=False for forward nodes: running statistics stay where they are; first=True for
        # gradients: their first compute, with the weight gradients, is what a step costs
        if node.kind == "forward":
            return kernels.forward(node.name, table, first=False)
        if node.kind == "loss":
            return kernels.loss(table)
        return kernels.backward(node.name, table, first=True, grads={})

    out = []
    for node in nodes:
        for _ in range(warmup):
            run(node)
        times = []
        for _ in range(repeat):
            sync()
            start = time.perf_counter()
            result = run(node)
            sync()
            times.append(time.perf_counter() - start)
        table[node.name] = result  # plain training keeps everything: each node finds its inputs
        out.append(NodeTiming(node.name, node.kind, tuple(times)))
        if on_node is not None:
            on_node(node.name)
    table.clear()
    return out


def costs_csv(timings: list[NodeTiming], watts: float | None = None) -> str:
    """The measured-costs file (`--costs`): one row per node, SI units."""
    if watts is not None and not (isinstance(watts, (int, float)) and math.isfinite(watts) and watts > 0):
        raise PoetError(f"expected a positive average power in watts, got {watts!r}", field="--watts")
    buf = io.StringIO()
    buf.write("name,time_s,energy_j\n")
    for t in timings:
        energy = "" if watts is None else repr(t.median_s * float(watts))
        name = t.name if not any(c in t.name for c in ',"\n') else '"' + t.name.replace('"', '""') + '"'
        buf.write(f"{name},{t.median_s!r},{energy}\n")
    return buf.getvalue()
