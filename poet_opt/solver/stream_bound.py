"""Recomputation inputs for the residency relaxation: what a recomputation's inputs hold in RAM.

The residency relaxation (residency.py) lets a tensor come back in a gap by a recomputation without
asking where the recomputation's inputs are. On ResNet-18's strips at 200 KiB its LP recomputes
32.5 MiB of ReLU and concat outputs for 0.05 J, from inputs that no plan has in RAM then. This
block adds rows that every plan obeys about those inputs, so the relaxation stays a relaxation.

Facts used (the stage model, docs/formulation.md): a tensor is in RAM during stage ``s`` only if it
is kept into ``s`` or materialized in ``s`` (recomputed, read again, paged in); kept into ``s+1``
only if in RAM during ``s`` (row 2); and what is kept into ``s+1`` fits beside node ``s``'s inputs
and output (row 9), which is the residency model's per-stage level. A tensor ``e``'s *touches* are
its own stage and its readers' (first computations, so in every plan); between two consecutive ones
``alpha < beta`` lies a *gap* of ``e``, after the last one its *tail*. A stage strictly inside a gap
or a tail neither makes nor reads ``e``, so ``e`` kept across it counts beside that stage's node.

A *requirement* is a recomputation of tensor ``t`` at an unknown stage ``s`` in a known range
``(lo, hi]``: the last materialization of ``t`` in one of its gaps ``(lo, hi)`` when that is a
recomputation (the residency model's ``R``, whose gap return is mapped to the gap's *last*
materialization: the model only asks that some return exist); or a recomputation of ``t`` in a
window of its tail (``XR`` below). Each input ``e`` of ``t`` is in RAM at ``s``. Take the gap or
tail of ``e`` holding ``(lo, hi]`` strictly inside it (none: no row). The range is cut into
``STRETCHES`` stretches ``[c_k, c_k+1)``; ``s`` lies in one. Then one of:

- *K*: ``e`` is not materialized in ``(alpha, s]`` (a tail: in ``(A, s]``, the window's anchor
  below). It is in RAM at ``s`` without being made there, so kept into ``s`` and, walking row 2
  back, into every stage from ``alpha+1`` on: kept across ``alpha+1..c_k-1``. And with ``t``'s own
  gap, ``s`` is ``t``'s last materialization before the gap's end ``hi``, which reads ``t``: ``t`` is
  kept across ``c_k+1 - 1..hi-1``. Both are facts about one tensor each: ``Zp`` ("kept from the
  interval's start up to p") and ``Ws`` ("kept from h to the gap's end") columns per interval.
- *M1* (a gap of ``e``): ``e`` is materialized in ``(alpha, s]`` and its last materialization in the
  gap is at or before ``s``: stage ``beta`` reads ``e``, so it is kept across ``hi..beta-1``.
- *M2* (a gap): materialized in ``(alpha, s]`` and again after ``s``: two materializations in the
  gap, one more than the residency model counts there, charged ``D`` once per gap at the cheapest
  of a recomputation and a page-in.
- the gap is kept whole (no materialization in it): the residency model counts ``e`` across it.
- *M* (a tail): ``e`` is materialized in the pair's window ``(A, hi]``: ``XR`` (a recomputation,
  itself a requirement with range ``(A, hi]``, whose inputs are in RAM then) or ``XP`` (a page-in,
  which needs the page-out). A recomputation that costs no less than a page-in is charged without
  rows for its inputs (fewer rows only relax). The pairs on one tail are taken in order and each window starts where
  the one before ends (the first at the tail's start; a pair overlapping the one before is left
  out), so windows are disjoint and each materialization charged is a distinct action.

Per interval (a gap, a tail's window) the ``Zp`` are prefixes of one another (each at most the one
before) and the ``Ws`` suffixes; per stretch of stages between their ends one column ``V``, at least
every ``Zp`` and ``Ws`` covering it, holds the tensor's bytes in the residency model's levels. A plan
maps onto the block with ``Zp``, ``Ws`` and ``V`` 1 exactly where the tensor is kept, and the
columns of a gap only when the gap is returned (a gap kept whole is counted by the residency model),
so each stage counts each tensor's bytes at most once, where the residency model does not; ``D``,
``XR`` and ``XP`` are distinct actions of the plan, each counted once. So every plan still maps onto
a point of the model at no more than its energy, and the LP optimum with these rows, or HiGHS's dual
bound on its MILP, bounds every plan in this execution order. New columns are continuous (the
relaxation of a relaxation), and stay out of the runtime row (fewer terms in a ``<=`` row relax it).

Three more kinds of rows close what a stretch and a window leave uncounted: a tail window after the
first counts its input from its own start stage (``since`` below); ``_either`` counts the input or
the output across a stretch's uncounted stages; and ``_support`` asks, at every stage of a gap
returned by a recomputation, for something of the recomputation's tree to be kept there or made
again. ``_input_return_rows`` does the same for a recomputation whose input is read elsewhere too,
counting each return of that input within the gap as the distinct action it is. Each docstring
gives its argument; docs/formulation.md gives them together.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from poet_opt.device.costs import NodeCosts
from poet_opt.model.graph import TrainingGraph


@dataclass
class Block:
    """Columns and rows to append to a Milp whose level chain has one row per stage. Column indices
    are absolute (the first new one is ``base``); ``rows`` are local to the block; ``level`` are
    (stage, column, coefficient) entries for the level chain's row of that stage."""

    base: int
    cost: list = field(default_factory=list)
    ub: list = field(default_factory=list)
    rows: list = field(default_factory=list)  # (row, col, val)
    lo: list = field(default_factory=list)
    hi: list = field(default_factory=list)
    level: list = field(default_factory=list)
    columns: dict = field(default_factory=dict)  # a name per kind of column, for counts in reports

    def col(self, kind: str, cost: float = 0.0, ub: float = 1.0) -> int:
        self.cost.append(cost), self.ub.append(ub)
        self.columns[kind] = self.columns.get(kind, 0) + 1
        return self.base + len(self.cost) - 1

    def row(self, terms, lo: float, hi: float) -> None:
        r = len(self.lo)
        for c, v in terms:
            self.rows.append((r, c, v))
        self.lo.append(lo), self.hi.append(hi)

    def hold(self, col: int, weight: float, first: int, last: int, T: int) -> None:
        """``col`` times ``weight`` bytes held across stages first..last."""
        self.level.append((first, col, -weight))
        if last + 1 < T:
            self.level.append((last + 1, col, weight))


# Stretches the range of a recomputation's stage is cut into: the plan's stage lies in one of them,
# and there the input is kept up to the stretch's start and the output from its end, so the rows
# miss at most one stretch of either's bytes. More stretches, more columns and a slower LP.
STRETCHES = 2


def support_block(graph: TrainingGraph, costs: NodeCosts, *, base: int, nb: np.ndarray, gaps, R: np.ndarray,
                  P: np.ndarray, O: np.ndarray, comp: np.ndarray, need: np.ndarray,
                  pageable: np.ndarray, parts: int | None = None, trees: bool = True,
                  input_returns: bool = True) -> Block:
    """The rows of the module docstring for the residency model's gaps (``gaps``: residency.Relaxed;
    ``R``, ``P``: its per-gap columns, ``O``: its per-tensor page-outs; ``nb``: bytes in units of the
    RAM budget; ``comp``/``need``: the formulation's horizons). ``trees``: also the rows of
    ``_either`` and ``_support`` (the docstring's last paragraph); ``input_returns``: also those of
    ``_input_return_rows``."""
    T = len(graph)
    parts = STRETCHES if parts is None else parts
    users = graph.users()
    deps = [sorted(set(n.deps)) for n in graph.nodes]
    touches = [sorted({i, *users[i]}) for i in range(T)]
    gap_of = {(int(i), int(a)): k for k, (i, a) in enumerate(zip(gaps.tensor, gaps.a))}
    block = Block(base)
    # t -> [(V column, lo, hi, t's own gap or None)]: t recomputed at a stage in (lo, hi], and with
    # its own gap, that recomputation is the last materialization there, so t is kept from it on
    requirements = defaultdict(list)
    for k in np.flatnonzero(gaps.can_r):
        t = int(gaps.tensor[k])
        if gaps.can_p[k] and costs.compute_j[t] >= costs.page_in_j[t] + costs.page_out_j[t]:
            continue  # dearer than paging it, page-out included: rows there would rarely bind
        if deps[t]:
            requirements[t].append((int(R[k]), int(gaps.a[k]), int(gaps.b[k]), int(k)))
    prefix = defaultdict(set)  # interval -> stages p: "kept across start..p" is asked
    suffix = defaultdict(set)  # gap -> stages h: "kept across h..beta-1" is asked
    pairs = []  # (V, interval of e, own gap, [(p, h) per stretch], M1's stage, columns of e's returns)
    tails = defaultdict(list)  # e -> [(V, lo, hi, own, cuts, t)]
    windows = defaultdict(list)  # e -> [(start, hi, XR or None, XP or None)] per window of its tail
    eithers = defaultdict(list)  # gap -> [(first, last, Y)]
    gap_inputs_only = set()  # requirements whose inputs get rows only in their gaps (_input_returns)
    leaning = _input_returns(block, gaps, nb, deps, users, touches, gap_of, requirements, gap_inputs_only, T) \
        if input_returns else []
    for t in range(T - 1, -1, -1):  # readers before what they read: a tail's pairs are all known at it
        anchor = touches[t][-1] if t in tails else None
        for V, lo, hi, own, cuts, reader in sorted(tails.pop(t, ()), key=lambda q: (q[1], q[2])):
            # Windows (anchor, hi] of one tail are disjoint, so a materialization of t in each is a
            # distinct action; a pair overlapping the window before it gets no row.
            if lo < anchor:
                continue
            start, anchor = anchor, hi
            # (t is the input here, the docstring's e.) In K it is kept into every stage from the
            # window's start + 1 to the recomputation without a materialization there, so kept across
            # the start stage too: no other window's chain reaches that stage (each ends a stage
            # before its last), and no node there reads t, but for the first window, which starts at
            # t's last reader (there t is in the node's working set, counted already).
            since = start + 1 if start == touches[t][-1] or not trees else start
            window = ("window", t, since - 1, start)
            stretches = _stretches(cuts, since - 1, own, hi)
            if stretches is None:
                continue
            returns = []
            recompute = float(costs.compute_j[t]) if comp[t] > start else np.inf
            page_in = float(costs.page_in_j[t]) if pageable[t] and need[t] > start else np.inf
            if np.isfinite(recompute):
                xr = block.col("XR", recompute)
                returns.append(xr)
                if deps[t] and recompute < page_in:  # (no less than a page-in: its inputs rarely matter)
                    requirements[t].append((xr, start, int(min(hi, comp[t])), None))
            if np.isfinite(page_in):
                xp = block.col("XP", page_in)
                block.row([(xp, 1.0), (int(O[t]), -1.0)], -np.inf, 0.0)
                returns.append(xp)
            windows[t].append((start, hi, xr if np.isfinite(recompute) else None,
                              xp if np.isfinite(page_in) else None))
            _ask(prefix, suffix, window, own, stretches)
            either = (t, reader, cuts) if own is not None and trees else None
            pairs.append((V, window, own, stretches, None, returns, either))
        for V, lo, hi, own in requirements.get(t, ()):
            cuts = _cuts(lo, hi, parts if own is not None else 1)
            for e in deps[t]:
                if nb[e] <= 0:
                    continue
                alpha, beta = _around(touches[e], lo, T)
                if hi >= beta:
                    continue  # a stage of (lo, hi] touches e: no row (e is there anyway)
                if beta == T:
                    if V not in gap_inputs_only:
                        tails[e].append((V, lo, hi, own, cuts, t))
                    continue
                gap = ("gap", gap_of[(e, alpha)])
                stretches = _stretches(cuts, alpha, own, hi)
                if stretches is None:
                    continue
                _ask(prefix, suffix, gap, own, stretches)
                suffix[gap].add(hi)  # M1: e kept across hi..beta-1
                pairs.append((V, gap, own, stretches, hi, None, None))
    chains = {}
    # in the order the intervals were first asked about: a set of ("gap", k) keys would iterate in an
    # order that changes with Python's string hashing, and with it the model's column order
    for interval in dict.fromkeys([*prefix, *suffix]):
        kind, which = interval[0], interval[1]
        if kind == "gap":
            e, alpha, beta = int(gaps.tensor[which]), int(gaps.a[which]), int(gaps.b[which])
            returned = [(int(R[which]), -1.0), (int(P[which]), -1.0)]
        else:  # a tail's window: from its anchor up to the last stage any of its prefixes reaches
            e, alpha, returned = which, interval[2], None
            beta = max(prefix[interval]) + 1
        chains[interval] = _chains(block, alpha, beta, sorted(prefix[interval]), sorted(suffix[interval]),
                                   nb[e], T, returned)
    extras = {}
    for V, interval, own, stretches, m1, returns, either in pairs:
        zp, ws, held_e = chains.get(interval, ({}, {}, []))
        terms = [(V, 1.0)]
        for k, (p, h) in enumerate(stretches):
            # the stretch's case needs both facts: a column at most each (one fact: that column)
            needs = ([zp[p]] if p is not None else []) + ([chains[("gap", own)][1][h]] if h is not None else [])
            case = _least(block, needs)
            terms.append((case, -1.0))
            if either is not None:
                e, t, cuts = either
                _either(block, case, cuts[k], cuts[k + 1] - 2, held_e,
                        chains[("gap", own)][2] if ("gap", own) in chains else [],
                        _either_bytes(nb, deps, e, t), T, eithers[own])
        if interval[0] == "gap":
            which = interval[1]
            terms.append((ws[m1], -1.0))
            if which not in extras:
                extras[which] = _second(block, gaps, which, costs, int(R[which]), int(P[which]))
            terms += [(c, -1.0) for c in extras[which]]
            terms += [(int(R[which]), 1.0), (int(P[which]), 1.0)]  # a gap kept whole: counted already
            block.row(terms, -np.inf, 1.0)
        else:
            terms += [(c, -1.0) for c in returns]
            block.row(terms, -np.inf, 0.0)
    kept = defaultdict(list)  # tensor -> (first, last, V) of every chain of its
    for interval, (_, _, held) in chains.items():
        owner = int(gaps.tensor[interval[1]]) if interval[0] == "gap" else interval[1]
        kept[owner] += held
    supported = {}  # gap -> the pieces of its _support rows
    for k in np.flatnonzero(gaps.can_r) if trees else ():
        made = _support(block, int(k), gaps, int(R[k]), nb, deps, users, kept, windows, eithers, T)
        if made:
            supported[int(k)] = made
    if leaning:
        _input_return_rows(block, leaning, gaps, costs, R, P, O, nb, kept, eithers, supported, extras, windows, T)
    return block


def _around(touches: list, lo: int, T: int) -> tuple[int, int]:
    """A tensor's touches (sorted) on either side of stage ``lo``: the last at or before it, which
    exists since the callers' tensor is an input made before ``lo``, and the first after it (``T``
    past its last: then ``lo`` lies in its tail)."""
    where = bisect.bisect_right(touches, lo)
    return touches[where - 1], touches[where] if where < len(touches) else T


def _stretches(cuts: list[int], start: int, own, hi: int):
    """Per stretch [first, next) of the recomputation's range: the stage p up to which the input is
    then kept from ``start + 1`` on (None: no stage), and the stage h from which the output is kept
    to the end of its own gap (None: none, or no gap). None when some stretch asks nothing."""
    out = []
    for first, nxt in zip(cuts, cuts[1:]):
        p = first - 1 if first - 1 > start else None
        h = nxt - 1 if own is not None and nxt - 1 < hi else None
        if p is None and h is None:
            return None
        out.append((p, h))
    return out


def _ask(prefix, suffix, interval, own, stretches) -> None:
    for p, h in stretches:
        if p is not None:
            prefix[interval].add(p)
        if h is not None:
            suffix[("gap", own)].add(h)


def _cuts(lo: int, hi: int, stretches: int) -> list[int]:
    """First stages of up to ``stretches`` stretches of lo+1..hi, and hi+1."""
    return sorted({lo + 1 + (k * (hi - lo)) // stretches for k in range(stretches)} | {hi + 1})


def _second(block: Block, gaps, k: int, costs: NodeCosts, r: int, p: int) -> list[int]:
    """D: a materialization in gap k besides its last (the one the residency model counts), at the
    cheapest of a recomputation and a page-in there; none when neither may happen."""
    e = int(gaps.tensor[k])
    cost = min(float(costs.compute_j[e]) if gaps.can_r[k] else np.inf,
               float(costs.page_in_j[e]) if gaps.can_p[k] else np.inf)
    if not np.isfinite(cost):
        return []
    d = block.col("D", cost)
    block.row([(d, 1.0), (r, -1.0), (p, -1.0)], -np.inf, 0.0)
    return [d]


def _chains(block: Block, alpha: int, beta: int, prefix: list[int], suffix: list[int], weight: float, T: int,
            returned) -> tuple[dict, dict]:
    """One interval's columns: Zp[p] "kept across alpha+1..p", Ws[h] "kept across h..beta-1", and per
    stretch between those stages one V, at least every Zp and Ws that covers it, holding the bytes.
    ``returned``: the gap's return columns, negated (None for a tail, which the residency model never
    counts): both chains are of a returned gap, a gap kept whole being counted already. Also returns
    the stretches as (first, last, V), for the rows of ``_either``."""
    zp = {p: block.col("Zp") for p in prefix}
    ws = {h: block.col("Ws") for h in suffix}
    for a, b in zip(prefix[1:], prefix):  # kept up to a later stage: kept up to an earlier one
        block.row([(zp[a], 1.0), (zp[b], -1.0)], -np.inf, 0.0)
    for a, b in zip(suffix, suffix[1:]):  # kept from an earlier stage: kept from a later one
        block.row([(ws[a], 1.0), (ws[b], -1.0)], -np.inf, 0.0)
    if returned is not None:
        for c in [zp[p] for p in prefix[:1]] + [ws[h] for h in suffix[-1:]]:
            block.row([(c, 1.0)] + returned, -np.inf, 0.0)
    cuts = sorted({alpha + 1, beta, *(p + 1 for p in prefix), *suffix})
    held = []
    for first, nxt in zip(cuts, cuts[1:]):
        last = nxt - 1
        k = bisect.bisect_left(prefix, last)  # the first prefix reaching past this stretch
        m = bisect.bisect_right(suffix, first) - 1  # the last suffix starting at or before it
        covers = ([zp[prefix[k]]] if k < len(prefix) else []) + ([ws[suffix[m]]] if m >= 0 else [])
        if not covers:
            continue
        v = covers[0]
        if len(covers) > 1:  # the tensor is kept there if either says so: at least both
            v = block.col("V")
            for c in covers:
                block.row([(v, 1.0), (c, -1.0)], 0.0, np.inf)
        block.hold(v, weight, first, last, T)
        held.append((first, last, v))
    return zp, ws, held


# A recomputation's stretch crossed by more kept-stretches than this gets no rows of ``_either`` (one
# column per piece: on ResNet-18 at 200 KiB the long forward-to-backward gaps would add 250,000).
EITHER_MAX_STRETCHES = 4


def _either_bytes(nb: np.ndarray, deps, e: int, t: int) -> float:
    """What ``_either`` may count for input ``e`` of ``t``: e's bytes, or its share of t's when t has
    several inputs (up to the recomputation each input is there, after it t, so the shares of t's
    inputs together count t's bytes at most once)."""
    inputs = sum(float(nb[d]) for d in deps[t] if nb[d] > 0)
    return min(float(nb[e]), float(nb[t]) * float(nb[e]) / inputs)


def _either(block: Block, case: int, first: int, last: int, kept_input, kept_output, weight: float,
            T: int, made: list) -> None:
    """The stages a recomputation's stretch leaves uncounted: ``case`` is the stretch's K case (t
    recomputed at a stage s in it from e kept since the window's start), so across each boundary of
    first..last e is kept (before s) or t is (from s on). The block counts either only where a chain
    says it is kept across a whole stretch of its own (``kept_input``, ``kept_output``: (first, last,
    V)); where neither does, a column ``Y`` at least ``case`` less those holds ``weight`` bytes. A
    plan maps onto it with Y 1 where neither tensor is kept across the whole stretch: it holds one of
    them at each boundary there, and no other column counts either of them: e's only chain in a tail
    is its window's, t's in its gap its own, and no other Y counts them (e's tail windows are
    disjoint, t's gaps are, and an input of one Y is in its tail where it is no Y's output)."""
    if weight > 0:
        made += _uncounted(block, "Y", first, last, [*kept_input, *kept_output], [(case, -1.0)], weight, T,
                           EITHER_MAX_STRETCHES)


def _uncounted(block: Block, kind: str, first: int, last: int, counted, need, weight: float, T: int,
               most: int, floor: float = 0.0) -> list:
    """Stages first..last cut where the ``counted`` stretches (first, last, V) start or end; per
    piece a new column holding ``weight`` bytes, with the row: it, plus the V columns covering the
    piece, plus the ``need`` terms, at least ``floor``. Nothing past ``most`` pieces (fewer rows only
    relax).
    Returns the pieces as (first, last, column)."""
    if last < first:
        return []
    points = {first, last + 1}
    for f, lst, _ in counted:
        points.update(p for p in (f, lst + 1) if first < p <= last)
    points = sorted(points)
    if len(points) - 1 > most:
        return []
    made = []
    for a, nxt in zip(points, points[1:]):
        col = block.col(kind)
        block.row([(col, 1.0), *need, *((v, 1.0) for f, lst, v in counted if f <= a <= lst)], floor, np.inf)
        block.hold(col, weight, a, nxt - 1, T)
        made.append((a, nxt - 1, col))
    return made


def _least(block: Block, needs: list[int]) -> int:
    """A column at most each of ``needs`` (the one itself when there is one)."""
    if len(needs) == 1:
        return needs[0]
    b = block.col("stretch")
    for c in needs:
        block.row([(b, 1.0), (c, -1.0)], -np.inf, 0.0)
    return b


# How deep _support follows single-reader inputs, and how many pieces (between the kept-stretches
# already counted) one gap's rows may be cut into: past either, fewer rows, which only relax.
SUPPORT_DEPTH = 6
SUPPORT_MAX_PIECES = 8


def _support(block: Block, k: int, gaps, r: int, nb: np.ndarray, deps, users, kept, windows, eithers,
             T: int) -> None:
    """What a recomputation stands on, across every stage of its gap. If the last materialization of
    tensor t in its gap (lo, hi) is a recomputation (``r``), say at s, then at every stage σ of
    lo+1..hi-1 something of t's recomputation tree is kept across σ: t itself from s on, and before s
    each input t needs at s is either kept from σ on or made again in (σ, s], by a page-in or by a
    recomputation whose own inputs are then, by the same argument, kept or made. The tree followed
    is t's inputs that only t reads, theirs, and so on (an input read elsewhere is left out: fewer
    alternatives only weaken the row, and those tensors may be counted by other rows), down to a
    level of several inputs or a tensor whose materializations some window of its tail does not
    price: those tensors' recomputations end it. Every tensor of the tree below t lies in its tail
    there (its only reader was computed before t), where the windows' XP and XR columns price each
    page-in and each recomputation of it (the windows must cover (lo, hi]). So per stage, either a
    column already counting one of the tree's tensors there (a chain's V, an either-row's Y), or a
    page-in or a final recomputation in a covering window, or a new column ``U`` holding the least of
    the tree's levels' bytes is at least r. A plan maps onto it with U 1 where none of those is: it
    then keeps one of the tree's tensors across that stage, which no other column counts (each tensor
    of the tree is in this one tree, t's gaps are disjoint, and its levels hold its whole tensor)."""
    t, lo, hi = int(gaps.tensor[k]), int(gaps.a[k]), int(gaps.b[k])
    first, last = lo + 1, hi - 1
    if last < first or nb[t] <= 0:
        return []
    members, weight, events, final = [t], float(nb[t]), [], None
    x = t
    for _ in range(SUPPORT_DEPTH):
        inputs = [d for d in deps[x] if nb[d] > 0 and set(users[d]) == {x}]
        cover = {d: _covering(windows.get(d, ()), lo, hi) for d in inputs}
        if not inputs or any(c is None for c in cover.values()):
            break
        members += inputs
        weight = min(weight, float(sum(nb[d] for d in inputs)))
        events += [xp for d in inputs for (_, _, _, xp) in cover[d] if xp is not None]
        final = [xr for d in inputs for (_, _, xr, _) in cover[d] if xr is not None]
        if len(inputs) > 1:
            break
        x = inputs[0]
    if final is None or weight <= 0:
        return []
    counted = [piece for m in members for piece in kept.get(m, ())] + list(eithers.get(k, ()))
    return _uncounted(block, "U", first, last, counted, [(r, -1.0)] + [(c, 1.0) for c in events + final],
                      weight, T, SUPPORT_MAX_PIECES)


def _covering(wins, lo: int, hi: int):
    """The windows (start, end] of a tail that meet (lo, hi], when together they cover it; else None."""
    meet = sorted((w for w in wins if w[0] < hi and w[1] > lo), key=lambda w: w[0])
    reach = lo
    for start, end, _, _ in meet:
        if start > reach:
            return None
        reach = max(reach, end)
    return meet if reach >= hi else None


def _input_returns(block: Block, gaps, nb: np.ndarray, deps, users, touches, gap_of, requirements,
                   gap_inputs_only: set, T: int) -> list:
    """The columns of ``_input_return_rows``. Per gap ``k`` = (lo, hi) of a recomputable tensor t
    (at least one stage inside) whose largest input e lies in one gap of its own (e's gap) across
    (lo, hi]: ``IP`` "e paged in within (lo, hi]"; and when e may be recomputed there, either ``IM``
    "m made within (lo, hi]", for m the largest input of e that only e reads (it is in its tail
    there), or, without such an m, ``IR`` "e recomputed within (lo, hi]", a requirement of e (its
    inputs in RAM then) with rows for the inputs that are in gaps only: its windows would displace
    the windows the other requirements of a tail were cut for. Returns (k, t, e, e's gap, IR, IP, m,
    IM) per such gap, a column None where it is not made."""
    largest, single, out = {}, {}, []
    for k in np.flatnonzero(gaps.can_r):
        t = int(gaps.tensor[k])
        if t not in largest:
            inputs = [d for d in deps[t] if nb[d] > 0]
            largest[t] = max(inputs, key=lambda d: nb[d]) if inputs and nb[t] > 0 else None
        e, lo, hi = largest[t], int(gaps.a[k]), int(gaps.b[k])
        if e is None or hi - lo < 2:
            continue
        alpha, beta = _around(touches[e], lo, T)
        eg = gap_of.get((e, alpha)) if hi < beta < T else None
        if eg is None:
            continue  # e read inside (lo, hi], or in its tail: other rows speak for it
        if e not in single:
            only = [d for d in deps[e] if nb[d] > 0 and set(users[d]) == {e}]
            single[e] = max(only, key=lambda d: nb[d]) if only else None
        m = single[e]
        ir = block.col("IR") if gaps.can_r[eg] and m is None else None
        ip = block.col("IP") if gaps.can_p[eg] else None
        im = block.col("IM") if gaps.can_r[eg] and m is not None else None
        if ir is None and ip is None and im is None:
            continue
        if ir is not None and deps[e]:
            requirements[e].append((ir, lo, hi, None))
            gap_inputs_only.add(ir)
        out.append((int(k), t, e, eg, ir, ip, m, im))
    return out


def _input_return_rows(block: Block, leaning: list, gaps, costs: NodeCosts, R, P, O, nb: np.ndarray, kept,
                       eithers, supported, extras, windows, T: int) -> None:
    """What a recomputation's input costs when it is read elsewhere too (``_support`` follows inputs
    only their recomputation reads). If t's last materialization in its gap (lo, hi) is a
    recomputation (``R[k]``), at s, and e's gap around it is returned (``R`` or ``P`` of it; a gap
    kept whole is counted by the residency model), then at every stage σ of lo+1..hi-1: t is kept
    across σ (from s on), or e is (before s, when e is not made in (σ, s]: it is in RAM at s), or e is
    made in (lo, hi] (``IP``, ``IR``), or, made by a recomputation at some s' in (σ, s], its input m
    is kept across σ or made in (lo, hi] (``IM``). So per piece of the gap between the stretches
    that already count t, e or m (chains' V, the pieces of ``_support``, ``_either`` and of these
    rows for e's gap), a column ``UI`` holding their least bytes is at least ``R[k]`` less those.

    Why it bounds: t's gaps are disjoint, so the gaps whose ``IP`` (or ``IR``, or ``IM``) is 1 each
    hold a distinct page-in (recomputation; materialization of m) of e. Per gap of e and per t, the
    ``IR`` and ``IP`` are at most the gap's counted return of that kind, plus ``D`` (a second
    materialization, ``_second``), plus ``ER``/``EP`` (further ones, at their cost); per m and t the
    ``IM`` at most the ``XR``/``XP`` of m's tail windows that meet those gaps plus ``EM`` (further
    ones, at the cheapest of a recomputation and a page-in of m). A plan maps onto the rows with the
    E's the least that meet them: each action they charge is one the plan takes and no other column
    charges. ``UI`` counts bytes no other column counts: t is counted only by its own gap's columns
    (gaps with ``_support`` or ``_either`` rows get none of these), e and m in e's gap only by e's
    chains, e's gap's ``_support`` and ``_either`` pieces and its ``UI`` (all in the row, so ``UI``
    is 0 where one of them counts), and the t's reading e share e's and m's bytes by t's bytes. So
    every plan still maps onto a point no dearer than itself. On one encoder block at 200 KiB these
    rows raise the LP with recomputation inputs from 24.47 J to 27.02 J (benchmarks/STREAMING.md)."""
    share = defaultdict(float)
    for e, t in {(r[2], r[1]) for r in leaning}:
        share[e] += float(nb[t])
    made_in = defaultdict(lambda: defaultdict(lambda: ([], [])))  # e's gap -> t -> (IR's, IP's)
    made_m = defaultdict(lambda: defaultdict(list))  # m -> t -> [(IM, lo, hi)]
    pieces = {}  # gap -> its UI pieces; e before t, so e's gap's are known when t's gap asks for them
    for k, t, e, eg, ir, ip, m, im in sorted(leaning, key=lambda r: r[1]):
        if k in supported or eithers.get(k):
            continue
        lo, hi = int(gaps.a[k]), int(gaps.b[k])
        part = float(nb[t]) / share[e]
        weight = min(float(nb[t]), float(nb[e]) * part, float(nb[m]) * part if m is not None else np.inf)
        made = [(c, 1.0) for c in (ir, ip, im) if c is not None]
        counted = [*kept.get(t, ()), *kept.get(e, ()), *supported.get(eg, ()), *eithers.get(eg, ()),
                   *(kept.get(m, ()) if m is not None else ()), *pieces.get(eg, ())]
        pieces[k] = _uncounted(block, "UI", lo + 1, hi - 1, counted,
                               [(int(R[k]), -1.0), *made, (int(R[eg]), -1.0), (int(P[eg]), -1.0)], weight, T,
                               SUPPORT_MAX_PIECES, floor=-1.0)
        if not pieces[k]:
            continue
        if ir is not None:
            made_in[eg][t][0].append(ir)
        if ip is not None:
            made_in[eg][t][1].append(ip)
            block.row([(ip, 1.0), (int(O[e]), -1.0)], -np.inf, 0.0)  # a page-in needs the page-out
        if im is not None:
            made_m[m][t].append((im, lo, hi))
    for eg, per_t in made_in.items():
        if eg not in extras:
            extras[eg] = _second(block, gaps, eg, costs, int(R[eg]), int(P[eg]))
        e = int(gaps.tensor[eg])
        most = max(max(len(irs), len(ips)) for irs, ips in per_t.values())
        further = {kind: (last, block.col(kind, cost, ub=float(most))) for kind, last, cost in (
            ("ER", int(R[eg]), float(costs.compute_j[e])), ("EP", int(P[eg]), float(costs.page_in_j[e])))}
        for irs, ips in per_t.values():
            for cols, kind in ((irs, "ER"), (ips, "EP")):
                if cols:
                    last, extra = further[kind]
                    block.row([(c, 1.0) for c in cols] + [(last, -1.0), (extra, -1.0)]
                              + [(c, -1.0) for c in extras[eg]], -np.inf, 0.0)
    for m, per_t in made_m.items():
        cost = min(float(costs.compute_j[m]), float(costs.page_in_j[m]) if gaps.pageable[m] else np.inf)
        extra = block.col("EM", cost, ub=float(max(len(cols) for cols in per_t.values())))
        for cols in per_t.values():
            meets = [c for start, end, xr, xp in windows.get(m, ()) for c in (xr, xp)
                     if c is not None and any(start < hi and end > lo for _, lo, hi in cols)]
            block.row([(im, 1.0) for im, _, _ in cols] + [(extra, -1.0)] + [(c, -1.0) for c in meets],
                      -np.inf, 0.0)
