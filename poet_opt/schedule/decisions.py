"""A plan as the solver chose it, in budgets and decisions, and the ordered steps it replays as.

The step order follows the formulation's stage semantics (docs/schedule-format.md has the replay
rules): stage t walks positions 0..t, paging in or recomputing at each position, computing node t
last and paging it out right away; a tensor is freed as soon as nothing later in the stage reads
it, unless it is kept for the next stage. Frees here happen no later than the formulation's
accounting assumes, so replayed memory never exceeds what the solver bounded.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Optional

from poet_opt.device.costs import NodeCosts
from poet_opt.errors import DeadlinePassed
from poet_opt.device.media import (packs_sectors, step_erased_bytes, storage_erased, storage_logs, storage_occupied,
                                   wear_levelled)
from poet_opt.model.graph import TrainingGraph
from poet_opt.model.tiling import TILE_MARK


@dataclass(frozen=True)
class Budgets:
    """What a plan may use: RAM in bytes, runtime in seconds (inf: no limit), storage in bytes (what
    the paged tensors may occupy, NodeCosts.storage_bytes), and the erase blocks their page-outs may
    wear per step (NodeCosts.erased_bytes; inf: no wear budget)."""

    ram_bytes: float
    runtime_s: float
    # on raw flash, with a wear budget, also at most the erase-block-aligned bytes it allows per step
    storage_bytes: float
    min_lifetime_steps: Optional[int] = None  # the wear budget (--min-lifetime-steps)
    # on wear-levelled media, the wear budget's allowance once the weight updates have taken theirs
    erase_bytes: float = math.inf


def storage_limits(costs: NodeCosts, budgets: Budgets) -> list[tuple]:
    """The linear limits on the set of paged tensors, as (bytes per paged tensor, limit) pairs: the
    space they occupy, and the erase blocks they wear per step where a wear budget bounds that
    separately. Every model of the plan (the MILPs, the starts, CP-SAT) adds one row per pair."""
    limits = [(costs.storage_bytes, float(budgets.storage_bytes))]
    if math.isfinite(budgets.erase_bytes):
        limits.append((costs.erased_bytes, float(budgets.erase_bytes)))
    return limits


class Keep:
    """A set of (t, i) pairs, "tensor i is in RAM at the start of stage t", stored as runs of
    consecutive stages per tensor. A training graph keeps most forward tensors from the forward pass
    to the backward pass, so the pairs grow with the square of the graph (2.8 billion at 100,000
    nodes) while the runs grow with the number of times a tensor leaves RAM and comes back. It
    behaves as a frozenset of pairs (membership, iteration, length, equality, union), and
    ``runs`` serves the code that must stay linear."""

    def __init__(self, runs: Optional[dict] = None):
        # tensor -> sorted tuple of disjoint, non-adjacent inclusive stage ranges (first, last)
        self._runs: dict[int, tuple[tuple[int, int], ...]] = {
            int(i): tuple((int(a), int(b)) for a, b in rs) for i, rs in (runs or {}).items() if rs}
        for rs in self._runs.values():
            if any(a > b for a, b in rs) or any(b + 1 >= c for (_, b), (c, _) in zip(rs, rs[1:])):
                raise ValueError("keep runs must be sorted, disjoint and not adjacent")
        self._len = sum(b - a + 1 for rs in self._runs.values() for a, b in rs)
        self._hash = None

    @classmethod
    def of(cls, keep) -> "Keep":
        """``keep`` as a Keep: a Keep as it is, any iterable of (t, i) pairs merged into runs."""
        if isinstance(keep, Keep):
            return keep
        stages: dict[int, list[int]] = {}
        for t, i in keep:
            stages.setdefault(int(i), []).append(int(t))
        return cls({i: _runs_of(ts) for i, ts in stages.items()})

    @classmethod
    def from_ranges(cls, ranges) -> "Keep":
        """From (i, first, last) triples, inclusive, in any order, overlapping or adjacent."""
        per: dict[int, list[tuple[int, int]]] = {}
        for i, a, b in ranges:
            if a <= b:
                per.setdefault(int(i), []).append((int(a), int(b)))
        merged = {}
        for i, rs in per.items():
            rs.sort()
            out = [list(rs[0])]
            for a, b in rs[1:]:
                if a <= out[-1][1] + 1:
                    out[-1][1] = max(out[-1][1], b)
                else:
                    out.append([a, b])
            merged[i] = tuple(map(tuple, out))
        return cls(merged)

    @property
    def runs(self) -> dict:
        return self._runs

    def __contains__(self, pair) -> bool:
        try:
            t, i = pair
        except (TypeError, ValueError):
            return False
        rs = self._runs.get(i)
        if not rs:
            return False
        k = bisect.bisect_right(rs, (t, math.inf)) - 1
        return k >= 0 and rs[k][0] <= t <= rs[k][1]

    def __iter__(self):
        for i, rs in self._runs.items():
            for a, b in rs:
                for t in range(a, b + 1):
                    yield (t, i)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __eq__(self, other) -> bool:
        if isinstance(other, Keep):
            return self._runs == other._runs
        if isinstance(other, (set, frozenset)):
            return len(other) == self._len and all(p in self for p in other)
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset((i, rs) for i, rs in self._runs.items()))
        return self._hash

    def __or__(self, other) -> "Keep":
        other = Keep.of(other)
        return Keep.from_ranges([(i, a, b) for k in (self, other) for i, rs in k._runs.items() for a, b in rs])

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"Keep({self._runs!r})"

    def __reduce__(self):
        return (Keep, (self._runs,))


def _runs_of(stages) -> tuple[tuple[int, int], ...]:
    stages = sorted(set(stages))
    runs: list[list[int]] = []
    for t in stages:
        if runs and t == runs[-1][1] + 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    return tuple(map(tuple, runs))


@dataclass(frozen=True)
class Decisions:
    """The solver's choices, as plain sets of (stage, node) pairs; node t at stage t is implicit.
    ``keep`` is always a Keep (any set of pairs given is converted): linear in the graph's size."""

    recompute: frozenset  # (t, i): recompute i at position i of stage t (i < t)
    page_in: frozenset  # (t, i): page i in at position i of stage t
    page_out: frozenset  # i: page i out right after computing it in stage i
    keep: Keep  # (t, i): i is in RAM at the start of stage t

    def __post_init__(self):
        if not isinstance(self.keep, Keep):
            object.__setattr__(self, "keep", Keep.of(self.keep))


def wear_storage_cap(storage, min_lifetime_steps: int) -> float:
    """The erase-block-aligned bytes a plan may page out per training step and still survive
    ``min_lifetime_steps`` steps. Each paged tensor's region is erased once per step (a tensor is
    paged out at most once, right after its first computation). With wear levelling the erases
    spread over the whole capacity: endurance * capacity / steps. Without, each region wears on
    its own and lasts `endurance` steps: any paging is allowed if that is enough, none otherwise."""
    if wear_levelled(storage):
        return float(storage.endurance_cycles * storage.capacity_bytes // min_lifetime_steps)
    return float(storage.capacity_bytes) if storage.endurance_cycles >= min_lifetime_steps else 0.0


def lifetime_steps(storage, erased_bytes_per_step: int) -> Optional[int]:
    """Training steps until the medium wears out under a plan that erases (pages out)
    ``erased_bytes_per_step`` aligned bytes each step; None when nothing is written."""
    if erased_bytes_per_step <= 0:
        return None
    if wear_levelled(storage):
        return int(storage.endurance_cycles * storage.capacity_bytes // erased_bytes_per_step)
    return int(storage.endurance_cycles)


def step_wear_bytes(storage, summed: float) -> int:
    """What a step wears whose page-outs and updates wear ``summed`` bytes each on its own: on a
    card written as a sequential log, the whole allocation units the log fills (device/media.py)."""
    return step_erased_bytes(summed, storage.erase_block_bytes, storage_logs(storage))


def paged_region_bytes(costs: NodeCosts, decisions: Decisions) -> float:
    """What the paged tensors occupy on storage (whole sectors or erase blocks, device/media.py), as
    the formulation's row (8) counts."""
    return float(sum(float(costs.storage_bytes[i]) for i in decisions.page_out))


def paged_erased_bytes(costs: NodeCosts, decisions: Decisions) -> float:
    """The erase blocks the page-outs wear per step, at worst (a tensor is paged out at most once)."""
    return float(sum(float(costs.erased_bytes[i]) for i in decisions.page_out))


def param_region_key(name: str, levelled: bool, node_id: int):
    """Which storage region a weights node lives in. On raw flash every node has its own
    erase-block-aligned region: slices of one layer are written back at different moments, and
    erasing a block two slices shared would wipe the one not yet written. A wear-levelling
    controller writes sectors wherever it likes, so one layer's slices share one region."""
    return name.split(TILE_MARK, 1)[0] if levelled else node_id


def _param_regions(graph: TrainingGraph, storage) -> tuple[dict, dict]:
    levelled, block = wear_levelled(storage), storage.erase_block_bytes
    if packs_sectors(storage.kind, levelled):  # each node in sectors of its own, packed (device/media.py)
        params = [n for n in graph.nodes if n.op == "param"]
        sizes = storage_occupied([n.bytes for n in params], storage)
        return {n.id: n.id for n in params}, {n.id: int(b) for n, b in zip(params, sizes)}
    key_of, size = {}, {}
    for n in graph.nodes:
        if n.op == "param":
            key_of[n.id] = param_region_key(n.name, levelled, n.id)
            size[key_of[n.id]] = size.get(key_of[n.id], 0) + n.bytes
    return key_of, {k: -(-b // block) * block for k, b in size.items()}


def update_region_bytes(graph: TrainingGraph, storage) -> int:
    """The erase blocks that the updates of streamed weights wear each step, a constant of the graph
    whatever the plan: each updated region's own blocks, or on a packed card every allocation unit
    the write-back of each weights node can touch, at worst, as for a page-out."""
    updated = sorted({p for n in graph.nodes for p in n.updates})
    if packs_sectors(storage.kind, wear_levelled(storage)):
        return int(storage_erased([graph.nodes[p].bytes for p in updated], storage).sum())
    key_of, region = _param_regions(graph, storage)
    return sum(region[k] for k in {key_of[p] for p in updated})


def stored_param_bytes(graph: TrainingGraph, storage) -> int:
    """Storage that streamed weights and optimizer state occupy for good: in whole erase blocks, or
    in whole sectors on a packed card."""
    return sum(_param_regions(graph, storage)[1].values())


def resident_at_peak(graph: TrainingGraph, steps: list[dict]) -> dict:
    """What RAM holds at the first moment of the replayed peak, by kind, in bytes."""
    # two linear passes (find the step, then replay up to it): copying the live set at every new
    # peak would be quadratic in the forward pass, where the peak rises step after step
    ram = peak = 0
    peak_step = -1
    for k, step in enumerate(steps):
        if step["op"] in ("compute", "page_in"):
            ram += graph.nodes[step["node"]].bytes
            if ram > peak:
                peak, peak_step = ram, k
        elif step["op"] == "free":
            ram -= graph.nodes[step["node"]].bytes
    at_peak: set[int] = set()
    for step in steps[:peak_step + 1]:
        if step["op"] in ("compute", "page_in"):
            at_peak.add(step["node"])
        elif step["op"] == "free":
            at_peak.discard(step["node"])
    kinds = {"activations": 0, "gradients": 0, "weights": 0, "optimizer_state": 0}
    for n in at_peak:
        node = graph.nodes[n]
        if node.op == "param":
            kind = "optimizer_state" if node.name.startswith("state:") else "weights"
        else:
            kind = "gradients" if node.is_backward else "activations"
        kinds[kind] += node.bytes
    return kinds


def plain_decisions(graph: TrainingGraph) -> Decisions:
    """Plain training: compute every node once, keep each tensor until its last reader."""
    last = graph.last_use()
    keep = Keep({i: ((i + 1, last[i]),) for i in range(len(graph)) if last[i] > i})
    return Decisions(frozenset(), frozenset(), frozenset(), keep)


def build_steps(graph: TrainingGraph, decisions: Decisions, deadline: Optional[float] = None) -> list[dict]:
    """The plan as steps; raises DeadlinePassed once ``time.perf_counter()`` passes ``deadline``
    (a plan with many recomputations replays for seconds at 10^5 nodes: sqrt(n)'s took 14 s)."""
    T = len(graph)
    nodes = graph.nodes
    recompute_at: dict[int, list[int]] = {}
    page_in_at: dict[int, list[int]] = {}
    for t, i in decisions.recompute:
        recompute_at.setdefault(t, []).append(i)
    for t, i in decisions.page_in:
        page_in_at.setdefault(t, []).append(i)
    # Linear in the steps, whatever the keeps: after stage t exactly the tensors kept into t + 1 are
    # resident (checked below), so the ones to free in stage t are among those whose run of keeps
    # ends at t, and the ones that must be resident after it are those whose run starts at t + 1.
    keep = decisions.keep
    ends_at: dict[int, list[int]] = {}
    starts_at: dict[int, list[int]] = {}
    for i, runs in keep.runs.items():
        for a, b in runs:
            ends_at.setdefault(b, []).append(i)
            starts_at.setdefault(a, []).append(i)

    steps: list[dict] = []
    resident: set[int] = set()
    for t in range(T):
        if deadline is not None and t % 512 == 0 and time.perf_counter() > deadline:
            raise DeadlinePassed
        computed = sorted(recompute_at.get(t, [])) + [t]
        paged_in = set(page_in_at.get(t, []))
        # last position in this stage at which each tensor is read or made
        last_touch: dict[int, int] = {}
        for k in computed:
            last_touch[k] = max(last_touch.get(k, -1), k)
            for d in nodes[k].deps:
                last_touch[d] = max(last_touch.get(d, -1), k)
        for i in paged_in:
            last_touch[i] = max(last_touch.get(i, -1), i)
        # what came in from the previous stage but is neither read here nor kept goes first
        for i in sorted(ends_at.get(t, ())):
            if i in resident and i not in last_touch:
                steps.append({"op": "free", "node": i})
                resident.discard(i)
        releases: dict[int, list[int]] = {}
        for i, pos in last_touch.items():
            if (t + 1, i) not in keep:
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
        missing = {i for i in starts_at.get(t + 1, ()) if i not in resident}
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
    read = written = 0
    counts = {"compute": 0, "page_in": 0, "page_out": 0, "free": 0}
    for step in steps:
        op, n = step["op"], step["node"]
        node = graph.nodes[n]
        counts[op] += 1
        if op == "compute":
            compute_j.append(costs.compute_j[n]), runtime.append(costs.compute_s[n])
            read += node.bytes if node.op in ("input", "param") else 0
            written += node.writes_bytes
        elif op == "page_in":
            page_in_j.append(costs.page_in_j[n]), runtime.append(costs.page_in_s[n])
            read += node.bytes
        elif op == "page_out":
            page_out_j.append(costs.page_out_j[n]), runtime.append(costs.page_out_s[n])
            stored.add(n)
            written += node.bytes
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
        "storage_read_bytes": int(read),
        "storage_written_bytes": int(written),
    }
