"""Cost model: device profile x training graph -> per-node time and energy, in SI units.

Compute: a node with a measured time (imported graphs, measured-cost files) takes that time at the
device's active power; otherwise FLOPs / throughput, with energy from the energy per FLOP. A measured
energy (``--costs``) replaces either energy.
Paging: latency + bytes / throughput, at the storage's power while it runs. Input nodes and streamed
weights (``param`` nodes) are "loaded", not computed: reading them from storage is their cost, so
re-reading one is a page-in. A node that updates streamed weights also pays for writing them back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from poet_opt.device.media import storage_erased, storage_occupied
from poet_opt.device.profiles import DeviceProfile
from poet_opt.errors import PoetError
from poet_opt.model.graph import TrainingGraph
from poet_opt.units import MAX_QUANTITY


@dataclass(frozen=True)
class NodeCosts:
    """Arrays indexed by node id."""

    compute_s: np.ndarray
    compute_j: np.ndarray
    page_out_s: np.ndarray
    page_out_j: np.ndarray
    page_in_s: np.ndarray
    page_in_j: np.ndarray
    storage_bytes: np.ndarray  # bytes a paged copy occupies: whole sectors or erase blocks (device/media.py)
    # bytes of erase blocks one page-out wears at worst; None: the same as storage_bytes
    erased_bytes: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.erased_bytes is None:
            object.__setattr__(self, "erased_bytes", self.storage_bytes)

    @property
    def plain_energy_j(self) -> float:
        return math.fsum(self.compute_j)

    @property
    def plain_runtime_s(self) -> float:
        return math.fsum(self.compute_s)


def node_costs(graph: TrainingGraph, profile: DeviceProfile) -> NodeCosts:
    n = len(graph)
    nbytes = np.array([node.bytes for node in graph.nodes], dtype=float)
    flops = np.array([node.flops for node in graph.nodes], dtype=float)
    measured = np.array([np.nan if node.compute_s is None else node.compute_s for node in graph.nodes])
    # inputs and streamed weights are read from storage, not computed
    is_input = np.array([node.op in ("input", "param") for node in graph.nodes])
    writes = np.array([node.writes_bytes for node in graph.nodes], dtype=float)

    compute = profile.compute
    compute_s = np.where(np.isnan(measured), flops / compute.flops_per_second, measured)
    compute_j = np.where(np.isnan(measured), flops * compute.joules_per_flop, measured * compute.power_w)
    measured_j = np.array([np.nan if node.compute_j is None else node.compute_j for node in graph.nodes])
    compute_j = np.where(np.isnan(measured_j), compute_j, measured_j)  # a measured energy wins over both

    read, write = profile.storage.read, profile.storage.write
    page_in_s = read.latency_s + nbytes / read.bytes_per_second
    page_out_s = write.latency_s + nbytes / write.bytes_per_second
    page_in_j = page_in_s * read.power_w
    page_out_j = page_out_s * write.power_w

    compute_s = np.where(is_input & np.isnan(measured), page_in_s, compute_s)
    compute_j = np.where(is_input & np.isnan(measured) & np.isnan(measured_j), page_in_j, compute_j)
    # an update writes the layer's new weights (and optimizer state) back as it runs, priced as a
    # page-out of that many bytes
    write_s = np.where(writes > 0, write.latency_s + writes / write.bytes_per_second, 0.0)
    compute_s = compute_s + write_s
    compute_j = compute_j + write_s * write.power_w

    storage_bytes = storage_occupied(nbytes, profile.storage)
    assert compute_s.shape == (n,)
    costs = NodeCosts(compute_s, compute_j, page_out_s, page_out_j, page_in_s, page_in_j, storage_bytes,
                      storage_erased(nbytes, profile.storage))
    _check_finite(costs, graph, profile)
    return costs


def storage_bus_seconds(storage, *, read_ops: int, bytes_read: int, write_ops: int, bytes_written: int) -> float:
    """The seconds the profile's storage model gives transfers of these totals: each command pays
    its latency once and its bytes at the rate, as a page-in or page-out does in :func:`node_costs`.
    Exact from totals, because the model is linear in commands and bytes; the firmware's emulated
    storage counts what the generated code actually issued (its commands need not be the plan's)."""
    read, write = storage.read, storage.write
    return (read_ops * read.latency_s + bytes_read / read.bytes_per_second
            + write_ops * write.latency_s + bytes_written / write.bytes_per_second)


def _check_finite(costs: NodeCosts, graph: TrainingGraph, profile: DeviceProfile) -> None:
    """The loaders bound every figure (docs/graphs.md, docs/profiles.md), so this should never fire;
    if a new importer or profile field slips past them, a total of inf must be bad input naming
    where it came from, not an OverflowError deep in the solver."""
    with np.errstate(over="ignore", invalid="ignore"):
        for name in ("compute_s", "compute_j", "page_out_s", "page_out_j", "page_in_s", "page_in_j"):
            values = getattr(costs, name)
            # a schedule may run every node in every stage: len(values) times the sum at worst
            if not np.sum(values) * max(len(values), 1) <= MAX_QUANTITY or not np.isfinite(values).all():
                raise PoetError(f"the {name} of {graph.name}'s nodes on {profile.name} add up past what a "
                                "schedule can sum (units.MAX_QUANTITY); check the graph's sizes, FLOPs and times against the profile's rates",
                                source=graph.meta.get("source") or profile.source, field=f"costs.{name}")
