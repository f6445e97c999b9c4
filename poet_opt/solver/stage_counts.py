"""How many large tensors fit beside a stage: counting rows for the residency relaxation.

The residency relaxation (residency.py) asks, per stage ``s``, that the bytes of the tensors kept
across ``s`` fit in the room beside its node: ``sum_g bytes_g k_g <= room_s`` with ``k_g = 1 - R_g -
P_g`` the keep of gap ``g``. Its LP keeps tensors at fractions, and where tensors are large against
the room that is far from any plan: with 60 KiB of room, three 26 KiB activation blocks kept at
three quarters each fit the row, while a plan keeps at most two. bert-base's weight slices (up to
97 KiB) and row blocks (27.5 KiB) against 200 KiB are that case: its paging LP rose from 335.3 J to 356.9 J
with these rows, its LP with recomputation from 278.1 J to 298.8 J (benchmarks/STREAMING.md).

For a divisor ``q >= 2`` give gap ``g`` the weight ``w_g = ceil(q bytes_g / B) - 1`` (``B`` the RAM
budget), the most ``j`` with ``bytes_g > j B / q``, and stage ``s`` the cap ``c_s = ceil(q room_s /
B) - 1`` (0 where ``room_s <= 0``). At every integer point of the relaxation,

    sum over the gaps kept across s of w_g  <=  c_s.

Proof: if the kept gaps' weights sum to ``W > 0``, their bytes sum to more than ``W B / q`` (each
with ``w_g > 0`` has more than ``w_g B / q``), and at most to ``room_s``; so ``W B < q room_s``,
``W <= ceil(q room_s / B) - 1``. With ``W = 0`` the cap, at least 0, holds. Every plan in the order
maps to such an integer point (residency.py), so the rows bound every plan exactly as the byte rows
do, and at fractional points they cut: in the example above, at ``q = 8`` (B = 200 KiB), each block
weighs 1, the cap is 2, and the fractions weigh 2.25. Everything is integer arithmetic on bytes, so
no rounding decides a cap.

The rows are chains like the byte rows (a gap enters one stage's count and leaves another's), two
entries per gap and divisor, one column and one row per stage and divisor; a divisor whose weights
are all zero (no tensor above ``B / q``) adds none. The Lagrangian (residency.lagrangian_bound)
prices them with one multiplier per stage and divisor, as it prices the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The divisors q: weights count a tensor's bytes in units of B / q. On bert-base at 200 KiB (weight
# slices of 0.23-0.47 B, row blocks of 0.137 B) 8 alone gives what any set of 2 to 12 gave, to 0.02%
# of its Lagrangian, and 4 alone nothing; each divisor is a chain of rows more for the LP
# (benchmarks/STREAMING.md, "Counting rows")
DIVISORS = (2, 4, 8)


@dataclass
class StageCounts:
    """Per divisor with any nonzero weight: the gaps' weights and the stages' caps (float arrays of
    integers, for the Milp's and the Lagrangian's arithmetic)."""

    divisors: tuple[int, ...]
    weight: list[np.ndarray]
    cap: list[np.ndarray]


def stage_counts(gap_bytes: np.ndarray, room_bytes: np.ndarray, budget_bytes: int,
                 divisors: tuple[int, ...] = DIVISORS) -> StageCounts:
    """The counting rows of the module docstring for gaps of ``gap_bytes`` bytes (their tensor's),
    stages with ``room_bytes`` beside their node's working set, and a RAM budget of ``budget_bytes``
    (an integer: no rows for an unbounded budget)."""
    sizes = np.asarray(gap_bytes, dtype=np.int64)
    room = np.asarray(room_bytes, dtype=np.int64)
    budget = int(budget_bytes)
    kept, weights, caps = [], [], []
    if budget <= 0:
        return StageCounts((), [], [])
    for q in divisors:
        # ceil(x / B) - 1 == (x - 1) // B for integers x >= 1; a tensor of no bytes weighs nothing
        w = np.where(sizes > 0, (q * sizes - 1) // budget, 0)
        if not np.any(w > 0):
            continue
        cap = np.where(room > 0, (q * room - 1) // budget, 0)
        kept.append(q), weights.append(w.astype(float)), caps.append(cap.astype(float))
    return StageCounts(tuple(kept), weights, caps)
