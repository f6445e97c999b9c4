"""The schedule document: a solved plan with its graph, device, costs, budgets and solver report,
as written to JSON (docs/schedule-format.md) and read back by the validator and the exporters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from poet_opt import __version__
from poet_opt.device.costs import NodeCosts
from poet_opt.device.profiles import DeviceProfile
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import (Budgets, Decisions, lifetime_steps, paged_erased_bytes, paged_region_bytes,
                                         resident_at_peak, step_wear_bytes, stored_param_bytes, update_region_bytes,
                                         wear_levelled)

FORMAT = "poet-opt/schedule@1"

# solver.status, strongest claim first (docs/schedule-format.md): proven optimal over every valid
# step sequence in any order; optimal for the execution order used; within the requested gap of
# that order's bound; then stopped without that proof (the gap says how far it got)
PROVEN_STATUSES = ("optimal", "optimal_for_order", "gap_limit")
STATUSES = PROVEN_STATUSES + ("time_limit", "interrupted", "stopped")


@dataclass
class Schedule:
    """A solved plan with everything needed to write, validate, export or report it."""

    model: str
    mode: str
    graph: TrainingGraph
    profile: DeviceProfile
    costs: NodeCosts
    budgets: Budgets
    decisions: Decisions
    steps: list[dict]
    totals: dict
    plain: dict
    solver: dict
    # node k of ``graph`` is node ``order[k]`` of the graph as it was given (empty: the same order)
    order: tuple = ()

    def memory(self) -> dict:
        """The whole footprint on the device: every weight (frozen ones too: an executor keeps them
        in RAM; firmware may place them in flash, which `poet-opt emulate` measures), the gradients
        of the trainable ones, optimizer state, the working peak and the profile's stack reserve;
        and the paged bytes against the storage's capacity."""
        params, grads = self.graph.param_bytes, self.graph.param_grad_bytes
        working = self.totals["peak_ram_bytes"]
        total = params + grads + working
        reserve = self.profile.memory.stack_reserve_bytes
        device = self.profile.memory.ram_bytes
        # streamed weights live on storage for good, beside the paged tensors in their sectors or blocks
        stored = stored_param_bytes(self.graph, self.profile.storage) + int(paged_region_bytes(self.costs,
                                                                                              self.decisions))
        return {
            # resident: weights (and gradients) in RAM all step, outside the plan; streamed: in the plan
            "weights": "streamed" if self.graph.streams_weights else "resident",
            "streamed_param_bytes": self.graph.streamed_param_bytes,
            "param_bytes": params,
            "param_grad_bytes": grads,
            # part of param_bytes: Adam's moments, owned by the update nodes (--optimizer adam)
            "optimizer_state_bytes": sum(n.param_bytes for n in self.graph.nodes if n.op.endswith("_update")),
            "working_peak_bytes": working,
            "total_bytes": total,
            "stack_reserve_bytes": reserve,
            "device_ram_bytes": device,
            "fits_device": total + reserve <= device,
            "storage_capacity_bytes": self.profile.storage.capacity_bytes,
            "stored_bytes": stored,
            "fits_storage": stored <= self.profile.storage.capacity_bytes,
            "resident_at_peak": resident_at_peak(self.graph, self.steps),
        }

    def erased_bytes_per_step(self) -> int:
        """Each page-out wears its tensor's erase blocks (at worst, device/media.py) once per step, and
        each update the regions of the weights it rewrites; a sequential log wears the whole units
        it fills."""
        return step_wear_bytes(self.profile.storage, paged_erased_bytes(self.costs, self.decisions)
                               + update_region_bytes(self.graph, self.profile.storage))

    def lifetime_steps(self) -> Optional[int]:
        """Training steps the storage survives under this plan (None: nothing is written)."""
        return lifetime_steps(self.profile.storage, self.erased_bytes_per_step())

    def recomputed_nodes(self) -> list[int]:
        return sorted({i for _, i in self.decisions.recompute})

    def paged_nodes(self) -> list[int]:
        return sorted(self.decisions.page_out)

    def given_ids(self) -> list:
        """For each node of the plan, the id of the node it is in the graph as the user gave it: the
        file's own ids for a graph file (its meta says them, in this graph's numbering), else its
        position in the graph handed to the solver."""
        given = self.graph.meta.get("given_ids")
        if given is not None:
            return list(given)
        return list(self.order) if self.order else list(range(len(self.graph.nodes)))

    def to_dict(self) -> dict:
        c, p = self.costs, self.profile
        nodes = []
        for node in self.graph.nodes:
            n = node.id
            nodes.append({
                "id": n, "name": node.name, "kind": node.kind, "op": node.op, "bytes": node.bytes,
                "deps": list(node.deps), "flops": node.flops, "param_bytes": node.param_bytes,
                "trainable": node.trainable, "updates": list(node.updates), "writes_bytes": node.writes_bytes,
                "compute_s": float(c.compute_s[n]), "compute_j": float(c.compute_j[n]),
                "page_out_s": float(c.page_out_s[n]), "page_out_j": float(c.page_out_j[n]),
                "page_in_s": float(c.page_in_s[n]), "page_in_j": float(c.page_in_j[n]),
            })
        return {
            "format": FORMAT,
            "generator": f"poet-opt {__version__}",
            "model": self.model,
            "mode": self.mode,
            "device": {
                "name": p.name, "source": p.source, "cpu": p.cpu, "ram_bytes": p.memory.ram_bytes,
                "bytes_per_element": p.memory.bytes_per_element, "alignment_bytes": p.memory.alignment_bytes,
                "storage_kind": p.storage.kind, "storage_capacity_bytes": p.storage.capacity_bytes,
                "erase_block_bytes": p.storage.erase_block_bytes, "endurance_cycles": p.storage.endurance_cycles,
                "wear_levelling": wear_levelled(p.storage), "write_cache": bool(p.storage.write_cache),
                "sequential_writes": bool(p.storage.sequential_writes),
                "stack_reserve_bytes": p.memory.stack_reserve_bytes,
            },
            "graph": {"name": self.graph.name, "nodes": nodes,
                      "given_ids": self.given_ids(),
                      # the whole input, batch first, where the importer knows it: lets `poet-opt run
                      # --schedule` say "another input shape" rather than only "other sizes"
                      "input_shape": _input_shape(self.graph),
                      # how the network was cut (streamed weights): what lowers it again to these nodes
                      **_tiling(self.graph)},
            "budgets": {
                "ram_bytes": int(self.budgets.ram_bytes),
                # null: no runtime limit (JSON has no infinity)
                "runtime_s": float(self.budgets.runtime_s) if math.isfinite(self.budgets.runtime_s) else None,
                "storage_bytes": int(self.budgets.storage_bytes),
                "min_lifetime_steps": self.budgets.min_lifetime_steps,
            },
            "steps": self.steps,
            "totals": self.totals,
            "memory": self.memory(),
            "plain": self.plain,
            "solver": self.solver,
        }


def _tiling(graph: TrainingGraph) -> dict:
    """The weight tile and the strips per activation height a streamed graph was cut with."""
    meta = graph.meta
    if meta.get("weights") != "streamed":
        return {}
    strips = meta["strips"].per_height if meta.get("strips") is not None else {}
    return {"tiling": {"weight_tile_bytes": meta.get("weight_tile_bytes"),
                       "strips_per_height": {str(h): int(k) for h, k in strips.items()}}}


def _input_shape(graph: TrainingGraph) -> Optional[list]:
    """The whole input, batch first: the torch and ONNX importers record it so, the zoo without the
    batch; a node-link graph has none (null)."""
    meta = graph.meta
    shape = meta.get("input_shape")
    if not shape:
        return None
    if "format" in meta:  # torch.fx, onnx: already batch first
        return [int(d) for d in shape]
    return [int(meta.get("batch_size", 1)), *(int(d) for d in shape)]
