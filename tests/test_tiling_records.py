"""The typed records of a tiled graph (model/tiling_records.py) answer the same questions for every
tiling: which tensor a node computes a part of, and which ranges of it, consistent with the bytes
the graph gives the node."""

import math
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from poet_opt.model.tiling_records import (RowTiling, StripTiling, WeightSlices, partition, receptive, touching,
                                           window_rows)
from poet_opt.model.zoo import build_model


def test_partition_covers_once_in_near_equal_ranges():
    assert partition(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert partition(2, 5) == [(0, 1), (1, 2)]  # capped at one row each


def test_a_strip_node_covers_the_rows_its_bytes_say():
    graph = build_model("resnet18-cifar", weights="streamed", strips={32: 8, 16: 4}, tile_bytes=48 * 1024)
    strips, tiles = graph.meta["strips"], graph.meta["tiles"]
    assert isinstance(strips, StripTiling) and tiles and all(isinstance(s, WeightSlices) for s in tiles.values())
    checked = 0
    for node in graph.nodes:
        rec = strips.nodes[node.name]
        if rec.role != "forward" or rec.rows is None:
            continue
        (lo, hi), layer = strips.ranges(node.name)["H"], strips.layers[rec.tensor]
        assert node.bytes == layer.shape[0] * (hi - lo) * layer.shape[2] * 4
        checked += 1
    assert checked > len(strips.tensors)
    for slices in tiles.values():  # a layer's slices cover its output features once, in order
        ranges = list(slices.ranges().values())
        assert ranges[0][0] == 0 and ranges[-1][1] == slices.features
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert [strips.layers[n].shape[0] for n in slices] == [hi - lo for lo, hi in ranges]
    again = pickle.loads(pickle.dumps(graph))  # the solver's worker processes receive graphs pickled
    assert again.meta["strips"].nodes == strips.nodes


def test_a_row_node_covers_the_tokens_and_features_its_bytes_say():
    graph = build_model("transformer-block", weights="streamed", rows={"blocks": 2, "piece": 64})
    rows = graph.meta["rows"]
    assert isinstance(rows, RowTiling)
    checked = 0
    for node in graph.nodes:
        rec = rows.nodes[node.name]
        ranges = rows.ranges(node.name)
        if rec.role not in ("forward", "grad", "linear") or "features" not in ranges or node.op == "input":
            continue
        (t0, t1), (f0, f1) = ranges["tokens"], ranges["features"]
        assert node.bytes == (t1 - t0) * (f1 - f0) * 4, node.name
        checked += 1
    assert checked > 100


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 40), k=st.integers(1, 7), s=st.integers(1, 3), p=st.integers(0, 3), data=st.data())
def test_window_rows_receptive_and_touching_agree_with_a_row_by_row_walk(h, k, s, p, data):
    """The geometry both replays take their row ranges from: output row m reads input rows
    m*s - p .. m*s - p + k - 1, and an input row is touched by exactly the outputs that read it."""
    h_out = (h + 2 * p - k) // s + 1
    if h_out < 1:
        return
    a = data.draw(st.integers(0, h_out - 1))
    b = data.draw(st.integers(a + 1, h_out))
    r0, r1 = window_rows((a, b), (k, s, p))
    read = {m * s - p + i for m in range(a, b) for i in range(k)}
    assert (r0, r1) == (min(read), max(read) + 1)
    assert receptive((a, b), (k, s, p), h) == (max(0, r0), min(h, r1))
    lo = data.draw(st.integers(0, h - 1))
    hi = data.draw(st.integers(lo + 1, h))
    readers = [m for m in range(h_out) if any(lo <= m * s - p + i < hi for i in range(k))]
    m0, m1 = touching((lo, hi), (k, s, p), h_out)
    assert list(range(m0, m1)) == readers


def test_strip_pieces_cover_a_row_range_once_in_order():
    graph = build_model("resnet18-cifar", weights="streamed", strips={32: 8, 16: 4}, tile_bytes=48 * 1024)
    strips = graph.meta["strips"]
    layer = next(name for name in strips.tensors if strips.layers[name].shape[1] == 32 and name != "input")
    assert strips.striped(layer) and len(strips.strips(layer)) == 8
    for lo, hi in [(0, 32), (3, 9), (4, 8), (31, 32), (-2, 5), (30, 40)]:
        pieces = strips.pieces(layer, lo, hi)
        covered = [r for _, _, (r0, r1) in pieces for r in range(r0, r1)]
        assert covered == list(range(max(0, lo), min(32, hi)))
        for j, (a, b), (r0, r1) in pieces:
            assert strips.strips(layer)[j] == (a, b) and a <= r0 < r1 <= b
            assert strips.strip_name(layer, j, "grad:") in {n.name for n in graph.nodes}
    assert strips.chain_end("stats:", layer) == f"stats:{layer}@s7"
    whole = next(name for name, lay in strips.layers.items() if len(lay.shape) == 3 and not strips.striped(name))
    assert strips.strips(whole) == [(0, strips.layers[whole].shape[1])] and strips.strip_name(whole, 0) == whole


def test_row_pieces_and_weight_tiles_cover_each_tensor_and_parameter_once():
    """The row geometry both replays take their ranges from: a tensor's feature pieces cover any
    column range once, and a layer's weight tiles cover each parameter once (a linear bias with
    the first input piece only)."""
    graph = build_model("transformer-block", weights="streamed", rows={"blocks": 2, "piece": 64})
    rows = graph.meta["rows"]
    names = {n.name for n in graph.nodes}
    for layer, cols in rows.cols.items():
        width = cols[-1][1]
        for lo, hi in [(0, width), (1, width - 1), (63, 65), (width - 1, width)]:
            if not 0 <= lo < hi <= width:
                continue
            got = [c for _, _, (r0, r1) in rows.pieces(layer, lo, hi) for c in range(r0, r1)]
            assert got == list(range(lo, hi))
        if not rows.heads(layer) and layer != "input":
            assert rows.tile_name(layer, 1, len(cols) - 1) in names
    covered: dict[str, int] = {}
    for node in graph.nodes:  # every weight tile the graph streams, as both replays cut it
        if node.name.startswith("param:"):
            layer, _, tile = node.name[len("param:"):].rpartition("#")
            for ranges in rows.tile_ranges(layer, tuple(int(t) for t in tile.split("."))).values():
                covered[layer] = covered.get(layer, 0) + math.prod(hi - lo for lo, hi in ranges)
    assert covered and covered.keys() == rows.tiles.keys()
    assert all(covered[layer] == rows.layers[layer].params for layer in covered)
