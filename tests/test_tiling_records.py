"""The typed records of a tiled graph (model/tiling_records.py) answer the same questions for every
tiling: which tensor a node computes a part of, and which ranges of it, consistent with the bytes
the graph gives the node."""

import pickle

from poet_opt.model.tiling_records import RowTiling, StripTiling, WeightSlices, partition
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
