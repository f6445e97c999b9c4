"""Static memory plan for a schedule: one RAM arena and one flash layout, fixed at export time.

Firmware without malloc needs every tensor at a known address. A tensor may be resident several
times (computed, freed, recomputed or paged back in); each such resident interval is placed on its
own, so a recomputed tensor may land somewhere else than its first copy. Works from the schedule
document (the JSON contract in docs/schedule-format.md), never from solver internals, so any valid
schedule file can be exported.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from poet_opt.device.media import SECTOR_BYTES, au_rewrites, logs_sequentially, packs_sectors
from poet_opt.errors import PoetError, shown


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment if alignment > 1 else value


MAX_DEVICE_INT = 2**63 - 1  # as a profile allows (docs/profiles.md)


def device_int(doc: dict, key: str, *, minimum: int = 1) -> int:
    """The validator replays steps and never reads `device`; the export does, so it checks here."""
    device = doc.get("device")
    if not isinstance(device, dict):
        raise PoetError("the schedule has no 'device' section; the export needs its alignment and flash figures")
    value = device.get(key)
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
    if not whole or not minimum <= value <= MAX_DEVICE_INT:
        raise PoetError(f"device.{key} is {shown(value)}; expected an integer from {minimum} to 2^63 - 1")
    value = int(value)
    if key == "alignment_bytes" and value & (value - 1):  # offsets are rounded up to it with a mask in C
        raise PoetError(f"device.alignment_bytes is {value}; expected a power of two (1, 2, 4, 8, 16, ...)")
    return value


@dataclass(frozen=True)
class Interval:
    """Node `node` resident from step `start` (its compute or page_in) until step `end` (its free,
    or len(steps)); live at steps start <= s < end, matching the validator's accounting in which
    RAM is measured after each compute/page_in and a free releases at once."""

    node: int
    start: int
    end: int
    bytes: int

    def overlaps(self, other: "Interval") -> bool:
        return self.start < other.end and other.start < self.end


@dataclass
class ArenaPlan:
    alignment: int
    intervals: list[Interval]
    offsets: list[int]               # arena offset of intervals[k]
    step_offsets: list[int]          # per step: arena offset of the tensor the step touches
    operand_offsets: list[list[int]]  # per step: arena offsets of a compute's inputs, in deps order
    arena_bytes: int
    live_peak_bytes: int
    strategy: str = ""
    step_interval: list[int] = field(default_factory=list)  # per step: index into intervals
    lower_bound_bytes: int = 0       # no placement can do better: the live peak plus unavoidable padding

    @property
    def ratio(self) -> float:
        return self.arena_bytes / self.live_peak_bytes if self.live_peak_bytes else 1.0


def resident_intervals(doc: dict) -> tuple[list[Interval], list[int]]:
    """The resident intervals and, per step, the interval it touches."""
    nodes = doc["graph"]["nodes"]
    steps = doc["steps"]
    spans: list[tuple[int, int, int]] = []
    step_span: list[int] = []
    span_of: dict[int, int] = {}
    for s, step in enumerate(steps):
        op, n = step["op"], step["node"]
        if op in ("compute", "page_in"):
            span_of[n] = len(spans)
            spans.append((n, s, len(steps)))
        step_span.append(span_of[n])
        if op == "free":
            k = span_of[n]
            spans[k] = (n, spans[k][1], s)
    return [Interval(n, a, b, int(nodes[n]["bytes"])) for n, a, b in spans], step_span


def _neighbours(intervals: list[Interval]) -> list[list[int]]:
    """For each interval, the others live at some same step (the conflicts, whatever the order)."""
    by_start = sorted(range(len(intervals)), key=lambda k: intervals[k].start)
    near: list[list[int]] = [[] for _ in intervals]
    for a, k in enumerate(by_start):
        for j in by_start[a + 1:]:
            if intervals[j].start >= intervals[k].end:
                break
            if intervals[k].bytes and intervals[j].bytes:
                near[k].append(j)
                near[j].append(k)
    return near


# Past this many conflicting intervals, an interval's first fit is found with numpy: the busy
# ranges sorted and scanned in C, about twice as fast as in Python on strip plans, where an
# interval may conflict with hundreds (the same offsets either way).
LONG_NEIGHBOURHOOD = 128


def _place(intervals: list[Interval], near: list[list[int]], order: list[int], alignment: int,
           offsets: list[int] | None = None, start: int = 0, limit: int | None = None,
           dirty: set[int] | None = None, near_array: dict | None = None) -> list[int] | None:
    """Greedy placement: each interval in `order` goes to the lowest aligned offset where it does
    not collide with an already placed interval that is live at the same time (first fit).
    With `offsets` from a placement of an order sharing the first `start` entries, those keep
    their offsets and only the rest is placed again. None as soon as an interval would end past
    `limit`: the search discards such orders, so it need not finish them.

    With `dirty` as well, `offsets` must be the placement of a whole order, and `dirty` must hold
    every interval that lost one of the neighbours placed before it in that order. The others keep
    their offsets unless a neighbour before them moved (then they are added to `dirty` here): a
    neighbour that came after them before and keeps its offset already avoided them, and a first
    fit does not change when ranges it does not collide with join its busy list. So only a few
    intervals are fitted again, to the same offsets. `near_array`: _long_neighbourhoods(near),
    for a caller that places many orders."""
    sizes = [iv.bytes for iv in intervals]
    placed = [-1] * len(intervals)
    if offsets is not None:
        for k in order[:start]:
            placed[k] = offsets[k]
    else:
        start, dirty = 0, None
    if near_array is None:
        near_array = _long_neighbourhoods(near, order[start:])
    if near_array:
        size_array, placed_array = np.asarray(sizes, dtype=np.int64), np.asarray(placed, dtype=np.int64)
    for k in order[start:]:
        if dirty is not None and k not in dirty:
            placed[k] = offset = offsets[k]
            if near_array:
                placed_array[k] = offset
            continue
        size = sizes[k]
        if k in near_array:
            offset = _first_fit_long(near_array[k], placed_array, size_array, size, alignment)
        else:
            busy = sorted([(p, p + sizes[j]) for j in near[k] if (p := placed[j]) >= 0])
            offset = 0
            for lo, hi in busy:
                if offset + size <= lo:
                    break
                if hi > offset:  # offsets are aligned, so only ends need rounding up
                    offset = -(-hi // alignment) * alignment
        if limit is not None and offset + size > limit:
            return None
        placed[k] = offset
        if near_array:
            placed_array[k] = offset
        if dirty is not None and offset != offsets[k]:
            dirty.update(near[k])
    return placed


def _long_neighbourhoods(near: list[list[int]], among) -> dict[int, np.ndarray]:
    return {k: np.asarray(near[k], dtype=np.int64) for k in among if len(near[k]) > LONG_NEIGHBOURHOOD}


def _first_fit_long(neighbours, placed, sizes, size: int, alignment: int) -> int:
    """_place's scan over the busy ranges sorted by start, vectorised: the offset before range i
    is the largest aligned end among the ranges before it, and the first range that starts at or
    past that offset plus `size` leaves room below it (ties in start cannot change the answer)."""
    starts = placed[neighbours]
    busy = starts >= 0
    lo = starts[busy]
    if not lo.size:
        return 0
    by_start = np.argsort(lo, kind="stable")
    lo = lo[by_start]
    aligned_ends = np.maximum.accumulate(-(-(lo + sizes[neighbours][busy][by_start]) // alignment) * alignment)
    before = np.concatenate(([0], aligned_ends[:-1]))
    room = np.flatnonzero(before + size <= lo)
    return int(before[room[0]]) if room.size else int(aligned_ends[-1])


def _extent(intervals: list[Interval], offsets: list[int]) -> int:
    return max((o + iv.bytes for o, iv in zip(offsets, intervals)), default=0)


def _ends(intervals: list[Interval], offsets: list[int]) -> list[int]:
    """Where each interval ends in the arena; 0 for an empty one, which no move needs to lower."""
    return [iv.bytes and o + iv.bytes for o, iv in zip(offsets, intervals)]


def live_peak(intervals: list[Interval]) -> int:
    events = sorted([(iv.start, iv.bytes) for iv in intervals] + [(iv.end, -iv.bytes) for iv in intervals],
                    key=lambda e: (e[0], e[1]))  # releases before acquisitions at the same step
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def padded_lower_bound(intervals: list[Interval], alignment: int) -> int:
    """No arena can be smaller: at every step the live tensors sit at aligned offsets without
    overlapping, so each but the topmost takes its size rounded up to the alignment (at best the
    topmost is the one with the most padding to save). Equals the
    live peak when every size is a multiple of the alignment."""
    events = sorted([(iv.start, 1, iv.bytes) for iv in intervals if iv.bytes]
                    + [(iv.end, -1, iv.bytes) for iv in intervals if iv.bytes])  # releases first at a step
    live_paddings: dict[int, int] = {}  # padding -> number of live tensors with it
    padded = bound = 0
    for _, delta, size in events:
        padding = align_up(size, alignment) - size
        padded += delta * (size + padding)
        live_paddings[padding] = live_paddings.get(padding, 0) + delta
        if not live_paddings[padding]:
            del live_paddings[padding]
        if delta > 0:  # a subset of what is live at this step: a valid bound, and the full set comes last
            bound = max(bound, padded - max(live_paddings))
    return bound


def plan_arena(doc: dict) -> ArenaPlan:
    """Place every resident interval of a (validated) schedule document in one arena.

    Classic greedy orders and seeded restarts first; if they leave fragmentation, a local search
    over the placement order; if the arena still exceeds the schedule's RAM budget, the same
    search for much longer (the stronger placement the export needs before it gives up). All
    of it is bounded by work, not time: one schedule document always gives one plan."""
    alignment = device_int(doc, "alignment_bytes")
    intervals, step_interval = resident_intervals(doc)
    near = _neighbours(intervals)
    bound = padded_lower_bound(intervals, alignment)
    arena_bytes, name, offsets, order = _best_placement(intervals, near, alignment, bound)
    strategy = f"{name} order"
    if arena_bytes > bound:
        budget = (doc.get("budgets") or {}).get("ram_bytes")
        arena_bytes, offsets, moves = _local_search(intervals, near, alignment, bound, order, offsets, SEARCH_WORK)
        if budget is not None and arena_bytes > budget:
            arena_bytes, offsets, more = _local_search(intervals, near, alignment, bound, order, offsets,
                                                       STRONG_SEARCH_WORK, seed=1)
            moves += more
        if moves:
            strategy += f", then {moves} local-search moves"
    peak = live_peak(intervals)

    nodes = doc["graph"]["nodes"]
    current: dict[int, int] = {}  # node -> its resident interval at this point of the replay
    step_offsets, operand_offsets = [], []
    for s, step in enumerate(doc["steps"]):
        k = step_interval[s]
        current[step["node"]] = k
        step_offsets.append(offsets[k])
        if step["op"] == "compute":
            operand_offsets.append([offsets[current[d]] for d in nodes[step["node"]]["deps"]])
        else:
            operand_offsets.append([])
    return ArenaPlan(alignment, intervals, offsets, step_offsets, operand_offsets, arena_bytes, peak,
                     strategy, step_interval, bound)


# Restarts and the local search are bounded by work (pairs of conflicting intervals visited), not
# by time, so the same schedule always gives the same header on any machine. A unit of work is
# about half a microsecond here: the search costs at most ~2 s, the stronger one ~15 s, and only
# when the arena would not fit the RAM budget otherwise.
RESTART_WORK = 4_000_000
MAX_RESTARTS = 128
SEARCH_WORK = 4_000_000
STRONG_SEARCH_WORK = 32_000_000


def _best_placement(intervals: list[Interval], near: list[list[int]], alignment: int,
                    bound: int) -> tuple[int, str, list[int], list[int]]:
    """Greedy by size (TFLite Micro's planner) plus a few other classic orders, then greedy by
    randomly perturbed sizes and areas: on training schedules (mixed sizes, recomputed copies)
    a single order can leave 30% fragmentation that a few dozen restarts remove. Stops early once
    the arena reaches the lower bound, which no placement can beat."""
    idx = range(len(intervals))
    life = [iv.end - iv.start for iv in intervals]
    size = [iv.bytes for iv in intervals]
    orders = {
        "size": lambda: sorted(idx, key=lambda k: (-size[k], -life[k], k)),
        "area": lambda: sorted(idx, key=lambda k: (-size[k] * life[k], k)),
        "start": lambda: sorted(idx, key=lambda k: (intervals[k].start, -size[k], k)),
        "lifetime": lambda: sorted(idx, key=lambda k: (-life[k], -size[k], k)),
    }
    rng = random.Random(0)
    work = len(intervals) + sum(map(len, near))
    restarts = min(MAX_RESTARTS, RESTART_WORK // max(work, 1))
    for t in range(restarts):
        w = [rng.uniform(0.5, 1.5) for _ in idx]
        by_area = t % 2
        orders[f"random-{t}"] = lambda w=w, a=by_area: sorted(idx, key=lambda k: (-size[k] * w[k] * (life[k] if a else 1), k))
    best = None
    near_array = _long_neighbourhoods(near, idx)
    for name, make_order in orders.items():
        order = make_order()
        # only a smaller arena replaces the best, so an order is dropped once it reaches the best's
        offsets = _place(intervals, near, order, alignment, limit=None if best is None else best[0] - 1,
                         near_array=near_array)
        if offsets is None:
            continue
        arena = _extent(intervals, offsets)
        if best is None or arena < best[0]:
            best = (arena, name, offsets, order)
        if best[0] <= bound:
            break
    return best


def _local_search(intervals: list[Interval], near: list[list[int]], alignment: int, bound: int,
                  order: list[int], offsets: list[int], work_limit: int, seed: int = 0) -> tuple[int, list[int], int]:
    """Hill-climb over the placement order, keeping every move that does not grow the arena
    (sideways moves let it cross plateaus). A move takes an interval that reaches the top of the
    arena and places it earlier, or swaps two intervals; only the order from the first changed
    position on is placed again. Updates `order` in place; returns (arena, offsets, moves kept)."""
    rng = random.Random(seed)
    arena = _extent(intervals, offsets)
    pair_work = [1 + len(n) for n in near]
    near_array = _long_neighbourhoods(near, range(len(intervals)))
    ends = _ends(intervals, offsets)
    spent = kept = 0
    n = len(order)
    # both moves permute order[first:] among itself, so the suffix's work is the total less the prefix's
    work_before = [0, *accumulate(pair_work[k] for k in order)]
    while arena > bound and spent < work_limit and n > 1:
        candidate = list(order)
        top = [k for k in range(n) if ends[k] == arena]
        if top and rng.random() < 0.5:
            k = rng.choice(top)
            old = candidate.index(k)
            first = rng.randrange(0, old + 1)
            candidate.insert(first, candidate.pop(old))
            dirty = {k}  # only k lost neighbours before it
        else:
            i, j = rng.randrange(n), rng.randrange(n)
            candidate[i], candidate[j] = candidate[j], candidate[i]
            first = min(i, j)
            # the one moved earlier lost neighbours before it, and so did those of the one moved later
            dirty = {candidate[first], *near[candidate[max(i, j)]]}
        # counted as if the whole suffix were placed again, whatever _place skips
        spent += work_before[n] - work_before[first]
        placed = _place(intervals, near, candidate, alignment, offsets, first, limit=arena, dirty=dirty,
                        near_array=near_array)
        if placed is None:
            continue
        placed_ends = _ends(intervals, placed)
        extent = max(placed_ends, default=0)
        if extent <= arena:
            kept += extent < arena or candidate != order
            order[:], offsets, arena, ends = candidate, placed, extent, placed_ends
            work_before[first:] = accumulate((pair_work[k] for k in order[first:]), initial=work_before[first])
    return arena, offsets, kept


def check_no_overlap(plan: ArenaPlan) -> None:
    """Raise AssertionError if two intervals live at the same time share a byte, or an offset is misaligned."""
    ivs, offs = plan.intervals, plan.offsets
    for k, (iv, o) in enumerate(zip(ivs, offs)):
        assert o >= 0 and o % plan.alignment == 0, f"interval {k} at offset {o} is not {plan.alignment}-aligned"
        assert o + iv.bytes <= plan.arena_bytes, f"interval {k} ends past the arena"
        for j in range(k):
            other, p = ivs[j], offs[j]
            if iv.bytes and other.bytes and iv.overlaps(other):
                assert o + iv.bytes <= p or p + other.bytes <= o, (
                    f"node {iv.node} steps {iv.start}-{iv.end} at [{o}, {o + iv.bytes}) overlaps "
                    f"node {other.node} steps {other.start}-{other.end} at [{p}, {p + other.bytes})")


# ---------------------------------------------------------------- flash


@dataclass
class FlashPlan:
    erase_block: int
    endurance_cycles: int
    offsets: dict[int, int]        # node -> flash offset of its region
    region_bytes: dict[int, int]   # node -> region size (its bytes rounded up to erase blocks, or sectors if packed)
    writes_per_step: dict[int, int]  # node -> page_outs (or, for weights, updates) of it per training step
    flash_bytes: int
    bytes_written_per_step: int
    lifetime_steps: int | None     # None: nothing is written, flash never wears
    wear_levelling: bool = False   # lifetime_steps counts erases spread over the whole medium
    params: list[int] = field(default_factory=list)  # streamed weights' nodes, whose regions come first
    # paged tensors packed in 512-byte sectors (a wear-levelled block device) rather than whole erase blocks
    packed: bool = False
    write_cache: bool = False  # writes reach the medium gathered: a packed region wears its own sectors
    # a card that appends sequential writes: the regions written each step form one log, in the order
    # of the step's writes (nodes here), from an allocation-unit boundary (device/media.py)
    log: list[int] = field(default_factory=list)  # every write of a step, in order (repeats too)

    @property
    def param_bytes(self) -> int:
        """Storage the streamed weights occupy, in whole erase blocks (whole sectors if packed)."""
        return sum(self.region_bytes[n] for n in self.params)


def plan_flash(doc: dict) -> FlashPlan:
    """Every streamed weight tensor (a ``param`` node) and every paged tensor gets its own region:
    the weights first, in node order, so the image a board is provisioned with is the same for every
    plan of a graph; then the paged tensors in order of first page_out. Each region is erase blocks
    of its own on raw flash, and packed sector after sector on a wear-levelled block device (an SD
    card's controller places sectors itself; device/media.py).

    Writes per step: a paged tensor's region is erased and programmed at each of its page_outs;
    a weight region at each compute of a node that updates it (once a step), never for frozen
    layers, which are only read.

    Lifetime: an erase block survives `endurance_cycles` erases, and the block of tensor n is
    erased once each time n is written, i.e. writes_n times per training step. Region n thus
    lasts endurance * region_bytes / (bytes erased in it per step) = endurance / writes_n training
    steps, and the layout lasts as long as its most rewritten region. A wear-levelling flash
    translation layer (SD cards have one) could spread the writes over the whole partition instead;
    that optimistic figure is endurance * flash_bytes / (erased bytes per step), reported beside it.
    On a packed medium a page-out wears every allocation unit its write commands touch (whole
    sectors in one command, a partial last sector in another), as the emulated card counts.

    On a card that appends sequential writes (``device.sequential_writes``) the frozen weights come
    first and the regions written every step (paged tensors, updated weights) follow as a log from
    an allocation-unit boundary, in the order the step writes them: each write then starts where the
    previous one ended, and a step wears the units the log fills, no more (docs/wear.md).
    """
    block = device_int(doc, "erase_block_bytes")
    endurance = device_int(doc, "endurance_cycles", minimum=0)
    nodes = doc["graph"]["nodes"]
    offsets, regions, writes = {}, {}, {}
    end = written = 0
    device = doc.get("device") or {}
    capacity = device.get("storage_capacity_bytes")
    levelled = device.get("wear_levelling") is True and isinstance(capacity, int) and capacity > 0
    packed = packs_sectors(str(device.get("storage_kind")), levelled) and block % SECTOR_BYTES == 0

    def place(n: int, unit: int = block) -> None:
        nonlocal end
        offsets[n] = end = align_up(end, unit)
        regions[n] = align_up(max(1, int(nodes[n]["bytes"])), unit)
        end += regions[n]

    params = [n for n, node in enumerate(nodes) if node.get("op") == "param"]
    unit = SECTOR_BYTES if packed else block
    sequential = logs_sequentially(str(device.get("storage_kind")), levelled, device.get("write_cache") is True,
                                   device.get("sequential_writes") is True) and packed
    updated = list(dict.fromkeys(p for s in doc["steps"] if s["op"] == "compute"
                                 for p in nodes[s["node"]].get("updates", ())))
    log: list[int] = []  # every write of a step, in order
    first = params
    if sequential:  # the updated weights are placed in the step's order below, after an AU boundary
        first = [n for n in params if n not in set(updated)]
        params = first + updated
    for n in first:
        place(n, unit)
    if sequential:
        end = align_up(end, block)
    for step in doc["steps"]:
        n = step["node"]
        if step["op"] == "compute":
            for p in nodes[n].get("updates", ()):
                written += int(nodes[p]["bytes"])
                writes[p] = writes.get(p, 0) + 1
                if p not in offsets:
                    place(p, unit)
                log.append(p)
            continue
        if step["op"] != "page_out":
            continue
        written += int(nodes[n]["bytes"])
        writes[n] = writes.get(n, 0) + 1
        if n not in offsets:
            place(n, unit)
        log.append(n)
    lifetime = min(endurance // w for w in writes.values()) if writes else None
    flash = FlashPlan(block, endurance, offsets, regions, writes, end, written, lifetime, levelled, params, packed,
                      device.get("write_cache") is True, log if sequential else [])
    if levelled and writes:
        # a flash translation layer spreads the erases over the whole medium (the schedule's own
        # lifetime_steps says the same, docs/schedule-format.md)
        flash.lifetime_steps = endurance * capacity // erased_per_step(flash, nodes)
    return flash


def erased_per_step(flash: FlashPlan, nodes: list[dict]) -> int:
    """Bytes of erase blocks the writes of one step wear: a region's whole blocks per write, or on a
    packed medium the blocks each of a page-out's write commands touches where the tensor lies."""
    def touched(offset: int, nbytes: int) -> int:
        return (offset + nbytes - 1) // flash.erase_block - offset // flash.erase_block + 1 if nbytes else 0

    if flash.log:
        return logged_per_step(flash, [int(nodes[n]["bytes"]) for n in flash.log])
    erased = 0
    for n, w in flash.writes_per_step.items():
        if flash.packed and not flash.write_cache:
            whole = int(nodes[n]["bytes"]) // SECTOR_BYTES * SECTOR_BYTES
            units = touched(flash.offsets[n], whole) + (int(nodes[n]["bytes"]) > whole)
            erased += w * units * flash.erase_block
        else:
            erased += w * flash.region_bytes[n]
    return erased


def logged_per_step(flash: FlashPlan, sizes: list[int]) -> int:
    """Bytes of allocation units a step's writes wear on a sequential card: the card's rule
    (device/media.py) over the commands poet_page_out issues for each region of the log, in order
    (the whole sectors, then the partial last one), from the card as the previous step left it."""
    worn, open_unit = 0, None
    for _ in range(2):  # the second step's count is every later step's
        worn = 0
        for n, nbytes in zip(flash.log, sizes):
            whole = nbytes // SECTOR_BYTES * SECTOR_BYTES
            commands = [(flash.offsets[n], whole)] if whole else []
            if nbytes > whole:
                commands.append((flash.offsets[n] + whole, SECTOR_BYTES))
            for offset, length in commands:
                units, open_unit = au_rewrites(offset, length, flash.erase_block, open_unit)
                worn += units
    return worn * flash.erase_block


def wear_levelled_lifetime(flash: FlashPlan) -> int | None:
    erased = sum(flash.region_bytes[n] * w for n, w in flash.writes_per_step.items())
    return flash.endurance_cycles * flash.flash_bytes // erased if erased else None


def check_flash(flash: FlashPlan) -> None:
    spans = sorted((o, o + flash.region_bytes[n]) for n, o in flash.offsets.items())
    for (a, b), (c, _) in zip(spans, spans[1:]):
        assert b <= c, f"flash regions [{a}, {b}) and [{c}, ...) overlap"
    for n, o in flash.offsets.items():
        unit = SECTOR_BYTES if flash.packed else flash.erase_block
        assert o % unit == 0, f"node {n}: flash offset {o} is not {unit}-byte aligned"
    assert flash.flash_bytes == (spans[-1][1] if spans else 0)


def check_fits(doc: dict, plan: ArenaPlan, *, source: str | None = None) -> None:
    """The arena is what firmware allocates; fragmentation can push it past a budget the live peak meets."""
    budget = doc["budgets"]["ram_bytes"]
    if budget is not None and plan.arena_bytes > budget:
        raise PoetError(f"the static arena needs {plan.arena_bytes:,} B, more than the RAM budget {int(budget):,} B "
                        f"(live peak {plan.live_peak_bytes:,} B; fragmentation {plan.ratio:.3f}x); solve again with "
                        f"--export, which tightens the budget until the arena fits, or with a smaller --ram",
                        source=source)
