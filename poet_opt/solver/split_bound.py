"""The residency LP with recomputation inputs, cut into pieces: a bound where the whole LP is too large.

On bert-base at 200 KiB that LP has 1.32 million columns and no LP method here finishes it in the
time a solve has (benchmarks/STREAMING.md); the Lagrangian (residency.lagrangian_bound), which
drops every RAM row into the objective, answers in seconds but knows nothing of what a
recomputation stands on. This bound keeps most of both.

The graph's nodes (as tensors, and as the stages they are computed in) are cut into pieces, such as
one encoder layer with its backward pass (``pieces``). The RAM row of stage ``s``, which bounds the
bytes kept across ``s``, sums the pieces' bytes: ``own(s) + others(s) <= room(s)``, ``own`` those of
the piece that owns stage ``s``. Given stage prices ``lam >= 0`` (the Lagrangian's), every plan
satisfies, for every ``s``, ``lam[s] (own(s) + others(s) - room(s)) <= 0`` and, since ``others(s)
>= 0``, ``own(s) <= room(s)``. So the least of

    energy + sum_s lam[s] (kept bytes at s - room(s)) + the same for the count rows (stage_counts.py)

over the points that meet every row of the model except the RAM and count rows, plus the rows
``own(s) <= room(s)``, is at most any plan's energy. With those rows dropped, the rest splits by
piece: a tensor's gaps, page-out and the rows of stream_bound.py are given to one piece (a row
read by two pieces is given to one, and the other piece's columns in it enter it as free copies,
which only lowers its minimum), and a piece's columns pay ``lam`` for the bytes they keep across
other pieces' stages and for their counts everywhere, while its own stages' bytes are held by its
own level chain, at most ``room(s)`` and priced at ``lam[s]``. The runtime and storage rows are
dropped, which only lowers the minimum. Each piece is an LP of its own, solved at once beside the
others; the bound is the sum of what each piece's multipliers prove (dual_bound.py) and the
constant terms, less a margin for the rounding of those terms. With one piece it is the LP with
recomputation inputs with the count rows priced; with ``lam`` the LP's own multipliers, the LP.

On bert-base at 200 KiB (12 pieces) it proves 326.3 J where the Lagrangian proves 296.5 J and dual
ascent on the whole LP 301.5 J (benchmarks/STREAMING.md, "bert-base in pieces").
"""

from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import scipy.sparse as sp

from poet_opt.model.graph import TrainingGraph
from poet_opt.solver.backends import interrupted, solve_lps
from poet_opt.solver.dual_bound import UNIT_ROUNDOFF, dual_bound
from poet_opt.solver.formulation import Milp

# Nodes per piece: one of bert-base's encoder layers with its backward pass is about 4,600 (an LP of
# 122,000 rows that HiGHS's interior point solves in about 30 s); larger pieces prove more and take
# longer, superlinearly.
PIECE_NODES = 4_800
# A cut is placed where it splits the fewest rows (``pieces``), then where the fewest bytes of the
# forward pass cross it, within this share of a piece's length either side of where equal pieces
# would cut (between two encoder layers, or between a layer's attention and its feed-forward part,
# only the residual stream crosses).
CUT_SLACK = 0.3
# A piece whose multipliers prove this share of plain training's energy less than its interior-point
# objective is solved again without HiGHS's presolve (bert-base's pieces lose 0.03-0.12 J of 176 J)
RETRY_LOSS = 1e-3


def pieces(graph: TrainingGraph, *, nodes_per_piece: int = PIECE_NODES, model=None) -> np.ndarray:
    """The piece of each node: forward nodes in contiguous runs of the forward pass, each backward
    node with the latest forward node it reads (its layer's saved activations), or failing one with
    the earliest piece its backward inputs are in. Any assignment gives a valid bound; this one
    keeps a layer's forward and backward passes together, where the bytes a layer keeps for its
    backward pass are decided. With ``model`` (the residency.ResidencyModel the pieces will cut),
    each cut goes where the fewest of its rows of stream_bound.py span it, and among those where the
    fewest bytes cross: a row split between two pieces is lost to both (its other piece's columns
    enter it as free copies), and which rows are split is what decides the bound. On bert-base the
    bytes alone put each cut just before a layer norm, through 3,904 rows about recomputing its
    output; the rows put it 700 nodes earlier, through 172 (326.3 J to 336.9 J; on one encoder block
    in three pieces 24.75 J to 26.40 J, against 26.99 J for the whole LP)."""
    T = len(graph)
    backward = np.array([n.is_backward for n in graph.nodes], dtype=bool)
    anchor = np.arange(T)
    for node in graph.nodes:
        if not node.is_backward or not node.deps:
            continue
        ahead = [anchor[d] for d in node.deps if not backward[d]]
        anchor[node.id] = max(ahead) if ahead else min(anchor[d] for d in node.deps)
    count = max(1, round(T / max(nodes_per_piece, 1)))
    if count == 1:
        return np.zeros(T, dtype=np.int64)
    forward = np.flatnonzero(~backward)
    # bytes of forward tensors live across the cut after forward stage p (read by a later forward node)
    last_read = np.arange(T)
    for node in graph.nodes:
        if not node.is_backward:
            for d in node.deps:
                last_read[d] = max(last_read[d], node.id)
    crossing = np.zeros(T + 1)
    size = np.array([n.bytes for n in graph.nodes], dtype=float)
    live = forward[last_read[forward] > forward]
    np.add.at(crossing, live + 1, size[live])
    np.add.at(crossing, last_read[live] + 1, -size[live])
    crossing = np.cumsum(crossing)[:T]  # crossing[p]: bytes made at or before p, read after p
    split = _rows_across(model, anchor) if model is not None else np.zeros(T)
    # equal shares of all nodes by anchor, each cut moved to the forward stage that splits the fewest
    # rows, among those the one the fewest bytes cross
    weight = np.bincount(anchor, minlength=T).astype(float)
    cumulative = np.cumsum(weight)
    cuts = []
    for k in range(1, count):
        target = int(np.searchsorted(cumulative, k * T / count))
        reach = CUT_SLACK * T / count
        lo, hi = np.searchsorted(cumulative, cumulative[target] - reach), np.searchsorted(cumulative, cumulative[target] + reach)
        near = forward[(forward >= lo) & (forward <= hi) & (forward >= (cuts[-1] + 1 if cuts else 0))]
        if len(near):
            cuts.append(int(near[np.lexsort((crossing[near], split[near]))[0]]))
    return np.searchsorted(np.array(cuts, dtype=np.int64), anchor, side="left").astype(np.int64)


def _rows_across(model, anchor: np.ndarray) -> np.ndarray:
    """``out[p]``: how many of ``model``'s rows of stream_bound.py hold columns of tensors (a gap's
    return or page-in, a page-out) anchored at or before forward stage ``p`` and after it, so that a
    cut after ``p`` splits them. A row's other columns (stream_bound's own) follow its piece."""
    T = len(anchor)
    if model.block is None or not len(model.block.lo):
        return np.zeros(T)
    G = len(model.R)
    part = model.milp.A[model.base_rows:model.base_rows + len(model.block.lo)].tocsr()
    row_of_entry = np.repeat(np.arange(part.shape[0]), np.diff(part.indptr))
    col = part.indices
    tensor = col < 2 * G + T
    row_of_entry, col = row_of_entry[tensor], col[tensor]
    where = anchor[np.where(col < 2 * G, model.gaps.tensor[col % G], col - 2 * G)]
    first = np.full(part.shape[0], T)
    last = np.full(part.shape[0], -1)
    np.minimum.at(first, row_of_entry, where)
    np.maximum.at(last, row_of_entry, where)
    spans = first < last
    change = np.zeros(T + 1)
    np.add.at(change, first[spans], 1.0)
    np.add.at(change, last[spans], -1.0)
    return np.cumsum(change)[:T]


def split_bound(model, multipliers: np.ndarray, owner: np.ndarray, *, time_limit: float,
                workers: int) -> Optional[float]:
    """The bound of the module docstring for ``model`` (a residency.ResidencyModel with recomputation
    inputs; that module calls this one), at the Lagrangian's ``multipliers`` (lagrangian_bound's:
    ``lam``, then one row per divisor of the count rows; missing rows are zero) with ``owner`` the
    piece of each node. None when a piece's LP gives no bound in the time."""
    started = time.perf_counter()
    T, gaps = model.T, model.gaps
    milp = model.boxed()
    A = milp.A.tocsr()
    n_rows, n_cols = A.shape
    lam = np.zeros((1 + len(model.C), T))
    given = np.asarray(multipliers, dtype=float).reshape(-1, T)[:len(lam)]
    lam[:len(given)] = np.maximum(given, 0.0)

    col_owner, row_owner = _owners(model, A, owner)
    global_cols = np.zeros(n_cols, dtype=bool)  # the model's own levels: replaced by each piece's
    global_cols[model.L] = True
    for C in model.C:
        global_cols[C] = True
    G = len(model.R)

    def chain(k: int):
        """The entries of the model's k-th level chain (0: bytes, then each divisor's counts) off its
        own level columns, as (stage, column, value): level s is the sum over the entries at stages
        <= s of (that stage's right-hand side - value * x). A gap's share of the right-hand side is
        its R column's value there (it keeps ``weight * (1 - R - P)``)."""
        part = A[model.level_row0 + k * T:model.level_row0 + (k + 1) * T].tocoo()
        off = ~global_cols[part.col]
        return part.row[off].astype(np.int64), part.col[off].astype(np.int64), part.data[off]

    ent_st, ent_col, ent_val = chain(0)
    is_r = ent_col < G
    con_st, con_val, con_owner = ent_st[is_r], ent_val[is_r], col_owner[ent_col[is_r]]
    ent_owner = col_owner[ent_col]

    # the count rows, priced at every stage
    cost = np.asarray(milp.c, dtype=float).copy()
    constant, magnitude = float(milp.offset), abs(float(milp.offset))
    for k, cap in enumerate(model.counts.cap, start=1):
        st, col, val = chain(k)
        terms = val * _suffix(lam[k])[st]
        np.add.at(cost, col, -terms)
        constant += float(terms[col < G].sum()) - float((lam[k] * cap).sum())
        magnitude += 1.5 * float(np.abs(terms).sum()) + float(np.abs(lam[k] * cap).sum())

    subs = []
    for j in np.unique(owner):
        own_stages = np.flatnonzero(owner == j)
        ahead = _suffix(np.where(owner == j, 0.0, lam[0]))  # lam over the other pieces' stages
        mine = ent_owner == j
        piece_cost = np.zeros(n_cols)
        terms = -ent_val[mine] * ahead[ent_st[mine]]
        np.add.at(piece_cost, ent_col[mine], terms)
        magnitude += float((np.abs(terms) * np.abs(milp.ub[ent_col[mine]])).sum())
        held = con_owner == j
        offset = float((con_val[held] * ahead[con_st[held]]).sum())
        magnitude += float(np.abs(con_val[held] * ahead[con_st[held]]).sum())
        rows = np.flatnonzero(row_owner == j)
        part = A[rows]
        cols = np.union1d(np.unique(part.indices), np.flatnonzero(col_owner == j))
        cols = cols[~global_cols[cols]]
        at = np.full(n_cols, -1, dtype=np.int64)
        at[cols] = np.arange(len(cols))
        part = part[:, cols].tocoo()
        c = np.where(col_owner[cols] == j, cost[cols] + piece_cost[cols], 0.0)
        # the piece's own level chain over its own stages, each level at most the stage's room
        n_own = len(own_stages)
        k_ent = np.searchsorted(own_stages, ent_st[mine])
        keep = k_ent < n_own
        k_con = np.searchsorted(own_stages, con_st[held])
        # Each level's right-hand side is a whole number of bytes: summed as such, so that a level
        # that gains and loses the same bytes gets exactly 0, not a residue of 1e-18 that HiGHS's
        # interior point stalls on (bert-base: 2 of 12 pieces without a bound)
        whole = np.zeros(n_own, dtype=np.int64)
        np.add.at(whole, k_con[k_con < n_own], np.rint(con_val[held][k_con < n_own] * gaps.unit).astype(np.int64))
        rhs = whole / gaps.unit
        levels = len(cols) + np.arange(n_own)
        r = np.concatenate([part.row, len(rows) + k_ent[keep], len(rows) + np.arange(n_own), len(rows) + np.arange(1, n_own)])
        q = np.concatenate([part.col, at[ent_col[mine][keep]], levels, levels[:-1]])
        v = np.concatenate([part.data, ent_val[mine][keep], np.ones(n_own), -np.ones(max(n_own - 1, 0))])
        offset -= float((lam[0][own_stages] * gaps.room[own_stages]).sum())
        magnitude += float(np.abs(lam[0][own_stages] * gaps.room[own_stages]).sum())
        subs.append(Milp(c=np.concatenate([c, lam[0][own_stages]]), offset=offset,
                         A=sp.csr_matrix((v, (r, q)), shape=(len(rows) + n_own, len(cols) + n_own)),
                         row_lb=np.concatenate([milp.row_lb[rows], rhs]),
                         row_ub=np.concatenate([milp.row_ub[rows], rhs]),
                         lb=np.concatenate([milp.lb[cols], np.zeros(n_own)]),
                         ub=np.concatenate([milp.ub[cols], gaps.room[own_stages]]),
                         integrality=np.zeros(len(cols) + n_own, dtype=np.int8)))
    left = time_limit - (time.perf_counter() - started)
    if left <= 0.1:
        return None
    results = solve_lps(subs, time_limit=left, workers=workers, lp_solver="ipm")
    values = [_proven(sub, result) for sub, result in zip(subs, results)]

    def retry(again: list[int], **options) -> None:
        """Solve the pieces ``again`` once more with ``options``, in the time left, keeping what proves more."""
        left = time_limit - (time.perf_counter() - started)
        if not again or left <= 0.1 or interrupted():
            return
        for k, result in zip(again, solve_lps([subs[k] for k in again], time_limit=left, workers=workers, **options)):
            value = _proven(subs[k], result)
            if value is not None and (values[k] is None or value > values[k]):
                values[k], results[k] = value, result

    # The interior point, without crossover, now and then stalls after HiGHS's presolve, with
    # multipliers that prove nothing (bert-base: one of 12 pieces) or lose joules against its own
    # objective (11 J on a piece of two encoder layers): those pieces again without the presolve
    # (that piece: 73 s, where the simplex had no optimum after 300 s), in the time left. A piece's
    # objective is large (its prices' constants cancel across pieces): the loss is measured against
    # plain training's energy, RETRY_LOSS of it
    loss = RETRY_LOSS * abs(float(milp.offset))
    retry([k for k, (value, result) in enumerate(zip(values, results))
           if value is None or result.objective is None or value < result.objective - loss],
          lp_solver="ipm", presolve=False)
    # A piece the interior point failed twice (no objective: one of bert-base's pieces when cut in 24,
    # 31,000 rows, whose multipliers then proved -1.1 million J) gets the simplex in the time left
    # (there: 6 s)
    retry([k for k, value in enumerate(values) if value is None or results[k].objective is None])
    if any(value is None for value in values):
        return None
    total = constant + sum(values)
    # The terms above were summed in floating point: less the standard bound on that rounding
    # (dual_bound.py's docstring), with the count of terms taken as the model's size
    k = n_rows + n_cols + len(ent_st) + 4
    return total - 2 * (k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)) * magnitude if math.isfinite(total) else None


def _proven(sub: Milp, result) -> Optional[float]:
    return None if result is None or result.duals is None else dual_bound(sub, result.duals)


def _suffix(values: np.ndarray) -> np.ndarray:
    """``out[s]`` the sum of ``values[s:]``, with ``out[len(values)] = 0``."""
    return np.concatenate([np.cumsum(values[::-1])[::-1], [0.0]])


def _owners(model, A: sp.csr_matrix, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The piece of each column and row of ``model``: a gap's columns and rows, and a page-out, are
    its tensor's; a row of stream_bound.py the piece most of its gap and page-out columns are in, or
    failing those, most of its columns that have a piece; one of its columns the piece most of its
    rows are in. Any assignment is valid (the module docstring): this one keeps a recomputation's
    rows with its tensor."""
    n_rows, n_cols = A.shape
    G = len(model.R)
    tensor_owner = owner[model.gaps.tensor]
    col_owner = np.full(n_cols, -1, dtype=np.int64)
    col_owner[model.R], col_owner[model.P], col_owner[model.O] = tensor_owner, tensor_owner, owner
    row_owner = np.full(n_rows, -1, dtype=np.int64)
    row_owner[:G], row_owner[G:2 * G] = tensor_owner, tensor_owner
    if model.block is None or not len(model.block.lo):
        return col_owner, row_owner
    rows = np.arange(model.base_rows, model.base_rows + len(model.block.lo))
    part = A[rows].tocsr()
    part.sort_indices()
    row_of_entry = np.repeat(np.arange(len(rows)), np.diff(part.indptr))
    block_cols = np.arange(model.block.base, n_cols)
    csc = part[:, block_cols].tocsc()
    csc.sort_indices()
    col_of_entry = np.repeat(np.arange(len(block_cols)), np.diff(csc.indptr))
    pieces_count = int(owner.max()) + 1 if len(owner) else 1
    for _ in range(3):  # rows with block columns alone learn from those columns, and back
        has = np.flatnonzero(col_owner[part.indices] >= 0)
        votes = sp.csr_matrix((np.ones(len(has)), (row_of_entry[has], col_owner[part.indices[has]])),
                              shape=(len(rows), pieces_count)).toarray()
        unset = (row_owner[rows] < 0) & (votes.max(axis=1) > 0)
        row_owner[rows[unset]] = votes[unset].argmax(axis=1)
        has = np.flatnonzero(row_owner[rows][csc.indices] >= 0)
        votes = sp.csr_matrix((np.ones(len(has)), (col_of_entry[has], row_owner[rows][csc.indices[has]])),
                              shape=(len(block_cols), pieces_count)).toarray()
        unset = (col_owner[block_cols] < 0) & (votes.max(axis=1) > 0)
        col_owner[block_cols[unset]] = votes[unset].argmax(axis=1)
    fallback = int(owner[0]) if len(owner) else 0
    row_owner[rows[row_owner[rows] < 0]] = fallback
    col_owner[block_cols[col_owner[block_cols] < 0]] = fallback
    return col_owner, row_owner
