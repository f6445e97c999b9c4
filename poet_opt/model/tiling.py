"""Operator tiling: a layer whose weights are too big to hold at once becomes k layers over slices
of its output features, each with its own slice of the weights, joined by a ``concat``.

The maths is exact: output feature c of a convolution or a linear layer reads only row c of the
weights (and its bias), so slicing the output features slices the weights without overlap, and the
weight gradient of each slice is that slice's alone. The data gradient into the shared input is the
sum over slices, which the training graph accumulates slice by slice (zoo._training_graph) so that
only one slice of the weights is needed at a time. Slices are along the channel axis of a
convolution's (C, H, W) output and along the last axis otherwise (a linear layer's features, for
every token; an embedding's columns). The graph records the slices of each layer in
``graph.meta["tiles"]``, layer name -> :class:`~poet_opt.model.tiling_records.WeightSlices`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from poet_opt.model import ops as registry
from poet_opt.model.tiling_records import WeightSlices, partition

# the registry's layers that slice over their output features (concat joins the slices)
TILEABLE = tuple(n for n in registry.names(tiling="slices") if n != "concat")
TILE_MARK = "#"  # tile j of layer L is named L#j; the concat keeps the name L


def tile_count(op, bytes_per_element: int, max_weight_bytes: int | None) -> int:
    """How many slices keep each slice's weights within ``max_weight_bytes`` (1: no tiling)."""
    if max_weight_bytes is None or op.op not in TILEABLE or op.params * bytes_per_element <= max_weight_bytes:
        return 1
    features = op.shape[feature_axis(op)]
    # whole features per slice, so that the largest slice (slices differ by one feature) stays
    # within the size: dividing the bytes alone left slices one feature over it
    per_feature = op.params * bytes_per_element / features
    per_slice = max(1, int(max_weight_bytes // per_feature))
    return min(features, math.ceil(features / per_slice))


def tile_weights(ops: Sequence, train: set[int], bytes_per_element: int,
                 max_weight_bytes: int | None) -> tuple[list, set[int], dict[str, WeightSlices]]:
    """The forward ops with every layer over ``max_weight_bytes`` of weights split into slices;
    returns (ops, the trained ones among them, layer name -> its slices)."""
    out: list = []
    new_index: dict[int, int] = {}
    trained: set[int] = set()
    tiles_of: dict[str, WeightSlices] = {}
    for i, op in enumerate(ops):
        inputs = tuple(new_index[j] for j in op.inputs)
        k = tile_count(op, bytes_per_element, max_weight_bytes)
        if k == 1:
            new_index[i] = len(out)
            out.append(replace(op, inputs=inputs))
            if i in train:
                trained.add(new_index[i])
            continue
        axis = feature_axis(op)
        features = op.shape[axis]
        tile_ids = []
        for j, (lo, hi) in enumerate(slices(features, k)):
            share = (hi - lo) / features
            shape = tuple(hi - lo if a == axis else d for a, d in enumerate(op.shape))
            tile_ids.append(len(out))
            if i in train:
                trained.add(len(out))
            # weights and FLOPs split with the output features (each feature owns its row and bias)
            out.append(replace(op, name=f"{op.name}{TILE_MARK}{j}", shape=shape, inputs=inputs,
                               flops=op.flops * share, params=_share(op.params, lo, hi, features)))
        tiles_of[op.name] = WeightSlices(op.name, tuple(out[t].name for t in tile_ids), features)
        new_index[i] = len(out)
        out.append(replace(op, op="concat", inputs=tuple(tile_ids), flops=float(math.prod(op.shape)), params=0,
                           saves=""))
    return out, trained, tiles_of


def feature_axis(op) -> int:
    """The axis of a layer's output features: a convolution's channels, C of (C, H, W) per sample
    or of (N, C, H, W) with the batch (the zoo shapes per sample, the torch importer with the batch:
    taking axis 0 for both once sliced the importer's convolutions over the batch); the last axis of
    a linear layer or an embedding."""
    return len(op.shape) - 3 if op.op == "conv2d" else len(op.shape) - 1


def slices(n: int, k: int) -> list[tuple[int, int]]:
    """k contiguous ranges covering 0..n, sizes differing by at most one (k <= n: whole features)."""
    return partition(n, k)


def feature_ranges(features: int, tile_names) -> dict[str, tuple[int, int]]:
    """Tile name -> the output features [lo, hi) it computes, as :func:`tile_weights` cut them: the
    one place executors and the firmware learn a slice's share, whatever else splits its tensor."""
    tile_names = list(tile_names)
    return dict(zip(tile_names, slices(features, len(tile_names))))


def _share(total: int, lo: int, hi: int, n: int) -> int:
    """The whole parameters of features lo..hi when ``total`` spread evenly over n features (they
    do: each output feature has the same number of weights and one bias)."""
    return total * hi // n - total * lo // n
