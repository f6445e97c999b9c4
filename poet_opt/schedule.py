"""From solver decisions to an ordered plan of steps, its totals, and the schedule document.

The step order follows the formulation's stage semantics (docs/schedule-format.md has the replay
rules): stage t walks positions 0..t, paging in or recomputing at each position, computing node t
last and paging it out right away; a tensor is freed as soon as nothing later in the stage reads
it, unless it is kept for the next stage. Frees here happen no later than the formulation's
accounting assumes, so replayed memory never exceeds what the solver bounded.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .costs import NodeCosts
from .errors import PoetError
from .formulation import Budgets, Decisions
from .graph import TrainingGraph
from .profiles import DeviceProfile

FORMAT = "poet-opt/schedule@1"


def plain_decisions(graph: TrainingGraph) -> Decisions:
    """Plain training: compute every node once, keep each tensor until its last reader."""
    last = graph.last_use()
    keep = frozenset((t, i) for i in range(len(graph)) for t in range(i + 1, last[i] + 1))
    return Decisions(frozenset(), frozenset(), frozenset(), keep)


def build_steps(graph: TrainingGraph, decisions: Decisions) -> list[dict]:
    T = len(graph)
    nodes = graph.nodes
    recompute_at: dict[int, list[int]] = {}
    page_in_at: dict[int, list[int]] = {}
    for t, i in decisions.recompute:
        recompute_at.setdefault(t, []).append(i)
    for t, i in decisions.page_in:
        page_in_at.setdefault(t, []).append(i)
    keep_at: dict[int, set[int]] = {}
    for t, i in decisions.keep:
        keep_at.setdefault(t, set()).add(i)

    steps: list[dict] = []
    resident: set[int] = set()
    for t in range(T):
        computed = sorted(recompute_at.get(t, [])) + [t]
        paged_in = set(page_in_at.get(t, []))
        keep_next = keep_at.get(t + 1, set())
        # last position in this stage at which each tensor is read or made
        last_touch: dict[int, int] = {}
        for k in computed:
            last_touch[k] = max(last_touch.get(k, -1), k)
            for d in nodes[k].deps:
                last_touch[d] = max(last_touch.get(d, -1), k)
        for i in paged_in:
            last_touch[i] = max(last_touch.get(i, -1), i)
        # what came in from the previous stage but is neither read here nor kept goes first
        for i in sorted(resident):
            if i not in last_touch and i not in keep_next:
                steps.append({"op": "free", "node": i})
                resident.discard(i)
        releases: dict[int, list[int]] = {}
        for i, pos in last_touch.items():
            if i not in keep_next:
                releases.setdefault(pos, []).append(i)
        for k in sorted(set(computed) | paged_in):
            if k in paged_in:
                steps.append({"op": "page_in", "node": k})
                resident.add(k)
            if k in computed:
                steps.append({"op": "compute", "node": k})
                resident.add(k)
                if k == t and t in decisions.page_out:
                    steps.append({"op": "page_out", "node": k})
            for i in sorted(releases.get(k, [])):
                if i in resident:
                    steps.append({"op": "free", "node": i})
                    resident.discard(i)
        missing = keep_next - resident
        if missing:
            raise RuntimeError(f"decisions keep nodes {sorted(missing)} into stage {t + 1} that are not resident")
    for i in sorted(resident):
        steps.append({"op": "free", "node": i})
    return steps


def totals_of(graph: TrainingGraph, costs: NodeCosts, steps: list[dict]) -> dict:
    """What a plan costs. The validator recomputes this independently."""
    compute_j, page_in_j, page_out_j, runtime = [], [], [], []
    resident: set[int] = set()
    stored: set[int] = set()
    live = peak = 0
    counts = {"compute": 0, "page_in": 0, "page_out": 0, "free": 0}
    for step in steps:
        op, n = step["op"], step["node"]
        counts[op] += 1
        if op == "compute":
            compute_j.append(costs.compute_j[n]), runtime.append(costs.compute_s[n])
        elif op == "page_in":
            page_in_j.append(costs.page_in_j[n]), runtime.append(costs.page_in_s[n])
        elif op == "page_out":
            page_out_j.append(costs.page_out_j[n]), runtime.append(costs.page_out_s[n])
            stored.add(n)
        if op in ("compute", "page_in"):
            resident.add(n)
            live += graph.nodes[n].bytes
            peak = max(peak, live)
        elif op == "free":
            resident.discard(n)
            live -= graph.nodes[n].bytes
    cj, ij, oj = math.fsum(map(float, compute_j)), math.fsum(map(float, page_in_j)), math.fsum(map(float, page_out_j))
    return {
        "energy_j": math.fsum([cj, ij, oj]),
        "compute_j": cj,
        "page_in_j": ij,
        "page_out_j": oj,
        "runtime_s": math.fsum(map(float, runtime)),
        "peak_ram_bytes": int(peak),
        "storage_bytes": int(sum(graph.nodes[n].bytes for n in stored)),
        "computes": counts["compute"],
        "recomputes": counts["compute"] - len(graph),
        "page_ins": counts["page_in"],
        "page_outs": counts["page_out"],
    }


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

    def memory(self) -> dict:
        params, grads = self.graph.param_bytes, self.graph.param_grad_bytes
        working = self.totals["peak_ram_bytes"]
        total = params + grads + working
        return {
            "param_bytes": params,
            "param_grad_bytes": grads,
            # part of param_bytes: Adam's moments, owned by the update nodes (--optimizer adam)
            "optimizer_state_bytes": sum(n.param_bytes for n in self.graph.nodes if n.op.endswith("_update")),
            "working_peak_bytes": working,
            "total_bytes": total,
            "device_ram_bytes": self.profile.memory.ram_bytes,
            "fits_device": total <= self.profile.memory.ram_bytes,
        }

    def recomputed_nodes(self) -> list[int]:
        return sorted({i for _, i in self.decisions.recompute})

    def paged_nodes(self) -> list[int]:
        return sorted(self.decisions.page_out)

    def to_dict(self) -> dict:
        c, p = self.costs, self.profile
        nodes = []
        for node in self.graph.nodes:
            n = node.id
            nodes.append({
                "id": n, "name": node.name, "kind": node.kind, "op": node.op, "bytes": node.bytes,
                "deps": list(node.deps), "flops": node.flops, "param_bytes": node.param_bytes,
                "trainable": node.trainable,
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
            },
            "graph": {"name": self.graph.name, "nodes": nodes},
            "budgets": {
                "ram_bytes": int(self.budgets.ram_bytes),
                # null: no runtime limit (JSON has no infinity)
                "runtime_s": float(self.budgets.runtime_s) if math.isfinite(self.budgets.runtime_s) else None,
                "storage_bytes": int(self.budgets.storage_bytes),
            },
            "steps": self.steps,
            "totals": self.totals,
            "memory": self.memory(),
            "plain": self.plain,
            "solver": self.solver,
        }


def write_json_atomic(doc: dict, path: str | Path, *, field: str = "--out") -> None:
    def dump(fh):
        json.dump(doc, fh, indent=1)
        fh.write("\n")

    _write_atomic(path, dump, field)


def write_text_atomic(text: str, path: str | Path, *, field: str = "--out") -> None:
    _write_atomic(path, lambda fh: fh.write(text), field)


def _write_atomic(path: str | Path, write, field: str) -> None:
    """Write next to the target and rename, so a crash or a full disk never leaves half a file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise PoetError(f"cannot write here: {exc.strerror}", source=str(path), field=field) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            write(fh)
        # mkstemp creates 0600; give the file the mode an ordinary open() would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
