"""The arena planner's fast paths (numpy first fit for long neighbourhoods, the local search that
fits again only what a move can change) give exactly the offsets of the plain first-fit greedy and
hill-climb kept here: a header is a function of its schedule, so a faster planner must not move a
single tensor, nor let its work counter stop the search at another move."""

from __future__ import annotations

import random

import pytest

from poet_opt.firmware import arena
from poet_opt.firmware.arena import Interval, padded_lower_bound


def reference_place(intervals, near, order, alignment, offsets=None, start=0, limit=None):
    sizes = [iv.bytes for iv in intervals]
    placed = [-1] * len(intervals)
    if offsets is not None:
        for k in order[:start]:
            placed[k] = offsets[k]
    else:
        start = 0
    for k in order[start:]:
        size = sizes[k]
        busy = sorted((placed[j], placed[j] + sizes[j]) for j in near[k] if placed[j] >= 0)
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            if hi > offset:
                offset = -(-hi // alignment) * alignment
        if limit is not None and offset + size > limit:
            return None
        placed[k] = offset
    return placed


def reference_extent(intervals, offsets):
    return max((o + iv.bytes for o, iv in zip(offsets, intervals)), default=0)


def reference_local_search(intervals, near, alignment, bound, order, offsets, work_limit, seed=0):
    rng = random.Random(seed)
    area = reference_extent(intervals, offsets)
    pair_work = [1 + len(n) for n in near]
    spent = kept = 0
    n = len(order)
    while area > bound and spent < work_limit and n > 1:
        candidate = list(order)
        top = [k for k in range(n) if intervals[k].bytes and offsets[k] + intervals[k].bytes == area]
        if top and rng.random() < 0.5:
            k = rng.choice(top)
            old = candidate.index(k)
            first = rng.randrange(0, old + 1)
            candidate.insert(first, candidate.pop(old))
        else:
            i, j = rng.randrange(n), rng.randrange(n)
            candidate[i], candidate[j] = candidate[j], candidate[i]
            first = min(i, j)
        spent += sum(pair_work[k] for k in candidate[first:])
        placed = reference_place(intervals, near, candidate, alignment, offsets, first, limit=area)
        if placed is None:
            continue
        extent = reference_extent(intervals, placed)
        if extent <= area:
            kept += extent < area or candidate != order
            order[:], offsets, area = candidate, placed, extent
    return area, offsets, kept


def random_intervals(rng: random.Random, n: int) -> list[Interval]:
    """Short-lived activations among a few long-lived ones (more than LONG_NEIGHBOURHOOD
    neighbours at n = 400), odd sizes that need padding, and some empty tensors."""
    steps = 2 * n
    out = []
    for k in range(n):
        start = rng.randrange(steps)
        life = rng.randrange(steps) if rng.random() < 0.1 else rng.randrange(1, 12)
        size = 0 if rng.random() < 0.03 else rng.choice((8, 100, 1000, 1500, 3000, 4096, 10_000))
        out.append(Interval(k, start, min(steps, start + life), size))
    return out


def reference_best_placement(monkeypatch, intervals, near, alignment, bound):
    """_best_placement's orders, each placed in full by the reference."""
    with monkeypatch.context() as m:
        m.setattr(arena, "_place", lambda intervals, near, order, alignment, **_: reference_place(
            intervals, near, order, alignment))
        return arena._best_placement(intervals, near, alignment, bound)


@pytest.mark.parametrize("seed", range(12))
def test_placement_and_search_give_the_reference_offsets(seed, monkeypatch):
    rng = random.Random(seed)
    intervals = random_intervals(rng, rng.choice((30, 90, 400)))
    alignment = rng.choice((1, 4, 16))
    near = arena._neighbours(intervals)
    if len(intervals) == 400:
        assert max(map(len, near)) > arena.LONG_NEIGHBOURHOOD  # the numpy first fit is exercised too
    order = list(range(len(intervals)))
    rng.shuffle(order)
    assert arena._place(intervals, near, order, alignment) == reference_place(intervals, near, order, alignment)

    bound = padded_lower_bound(intervals, alignment)
    assert arena._best_placement(intervals, near, alignment, bound) == reference_best_placement(
        monkeypatch, intervals, near, alignment, bound)

    # from the shuffled order's placement, which leaves the search many moves to make
    offsets = reference_place(intervals, near, order, alignment)
    expected_order = list(order)
    expected = reference_local_search(intervals, near, alignment, bound, expected_order, offsets, 300_000, seed)
    got = arena._local_search(intervals, near, alignment, bound, order, offsets, 300_000, seed)
    assert got == expected and order == expected_order
    assert expected[2] > 0 or reference_extent(intervals, offsets) == bound  # it had moves to check
