"""Choosing a row tiling (model/rows.py) for a budget: the candidates, fewest nodes first, and the
first whose every node fits, tried on a cut-down copy of the model."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Sequence

from poet_opt.errors import PoetError


def _estimate(ops, blocks: int, piece: int, vocab_rows: int) -> float:
    """Roughly how many nodes a tiling makes: three per weight tile and row block (forward, data
    and weight gradient), the embeddings' tiles once per block and once for the update, attention
    and the token-wise operators three times per block and head or piece."""
    total = 0.0
    for o in ops:
        if o.op == "linear":
            total += 3 * blocks * math.ceil(o.shape[-1] / piece) * math.ceil(ops[o.inputs[0]].shape[-1] / piece)
        elif o.op == "embedding":
            total += (blocks + 1) * math.ceil(o.params / o.shape[-1] / vocab_rows) * math.ceil(o.shape[-1] / piece)
        elif o.op != "input":
            total += 3 * blocks * (o.shape[0] if len(o.shape) == 3 else math.ceil(o.shape[-1] / piece))
        if o.op == "matmul" and len(o.shape) != 3:  # K's and V's gradients: a link per pair of blocks
            total += 2 * blocks * blocks * math.ceil(o.shape[-1] / piece)
    return total


MAX_NODES = 200_000  # the solver's linear start takes about 30 s at 100,000 nodes


def row_tilings(ops, budget_bytes: int, bpe: int, blocks: int | None = None) -> list[dict]:
    """Candidate tilings, fewest nodes first: 1 to 16 row blocks or one per token (or ``blocks``, at
    most one per token), pieces of 8 to 256 features, embedding tiles of as many table rows as leave
    half the budget to the rest of their nodes; none whose weight tile alone exceeds half the
    budget (its update holds it and its sum)."""
    seq = ops[0].shape[0]
    out = []
    counts = {min(blocks, seq)} if blocks else {*range(1, min(seq, 16) + 1), seq}
    for blocks in sorted(counts):
        for piece in (8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256):
            if 2 * piece * piece * bpe > budget_bytes:
                continue
            tiling = {"blocks": blocks, "piece": piece, "vocab_rows": max(1, budget_bytes // (2 * piece * bpe))}
            if _estimate(ops, **tiling) <= MAX_NODES:
                out.append(tiling)
    if blocks and not out:
        raise PoetError(f"{min(blocks, seq)} row blocks make more than {MAX_NODES:,} nodes (attention sums K's and "
                        "V's gradients over every pair of blocks); ask for fewer, or auto", field="--strips")
    return sorted(out, key=lambda t: (_estimate(ops, t["blocks"], t["piece"], t["vocab_rows"]), t["blocks"]))


def proxy(ops: Sequence) -> list:
    """The model with its repeated encoder blocks cut to the first two: every kind of node, and so
    every working set, of the whole (a block's nodes are the same in each but the last, which
    leaves some out), at a sixth of bert-base's nodes, for trying tilings quickly."""
    keep: list = []
    new_index: dict[int, int | None] = {}
    for i, o in enumerate(ops):
        m = re.match(r"layer(\d+)\.", o.name)
        if m and int(m.group(1)) >= 2:
            new_index[i] = None
            continue
        # the first op after the dropped blocks reads the output of the last block kept
        inputs = tuple(len(keep) - 1 if new_index[x] is None else new_index[x] for x in o.inputs)
        new_index[i] = len(keep)
        keep.append(replace(o, inputs=inputs))
    return keep


def fit_rows(build, ops, budget_bytes: int, bpe: int, *, blocks: int | None = None,
             max_tries: int = 24) -> dict | None:
    """The tiling with the fewest nodes, of the candidates tried (``row_tilings`` order; only those
    of ``blocks`` row blocks if given), whose every node's working set fits ``budget_bytes``,
    checked on ``build(proxy ops, tiling)``; None when none of the first ``max_tries`` does."""
    small = proxy(ops)
    for tries, tiling in enumerate(row_tilings(ops, budget_bytes, bpe, blocks)):
        if tries >= max_tries:
            break
        if build(small, tiling).largest_working_set()[0] <= budget_bytes:
            return tiling
    return None
