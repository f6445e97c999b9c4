"""What every node of a tiled training graph computes, as typed records in ``graph.meta``.

A tiling cuts a tensor or a layer's weights into ranges along one axis: activation strips cut
(C, H, W) tensors along H (model/strips.py), row tiling cuts a transformer's (seq, d) tensors into
blocks of tokens by pieces of features and its weight matrices into tiles (model/rows.py), weight
slices cut a layer's output features (model/tiling.py). The builders record here what they cut,
and the replays (executor/strips.py, executor/rows.py, firmware/strip_codegen.py,
firmware/row_codegen.py) read the same records, so the PyTorch executor and the firmware generator
compute what the solver planned:

- ``graph.meta["strips"]``: a :class:`StripTiling`, its nodes :class:`StripRecord`;
- ``graph.meta["rows"]``: a :class:`RowTiling`, its nodes :class:`RowRecord`, its weight tiles
  :class:`WeightTiles`;
- ``graph.meta["tiles"]``: the weight slices, layer name -> :class:`WeightSlices`.

Every tiling answers the same questions: ``layers`` (forward operator -> :class:`TiledLayer`),
``nodes`` (node name -> :class:`NodeRecord`, whose ``tensor`` is the layer it computes or whose
gradient it computes) and ``ranges(name)`` (axis -> [lo, hi) of that tensor a node covers).
Ranges are (lo, hi) tuples, as the partition routines return them.

The geometry of a tiled graph is answered here too, once, for its builder and both replays: which
strips hold rows [lo, hi) of a tensor (:meth:`StripTiling.pieces`), which input rows a window of
output rows reads (:func:`window_rows`, padding included) and which output rows read some input
rows (:func:`touching`); which feature pieces hold columns [lo, hi) of a row-tiled tensor
(:meth:`RowTiling.pieces`) and which part of a layer's parameters a weight tile is
(:meth:`RowTiling.tile_ranges`); and what each tile of a tensor, of its gradient or of a chain of
statistics is called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

Range = tuple[int, int]
STRIP_MARK = "@s"  # strip j of tensor L is the node L@sj (L when it has one strip)
# row block b, feature piece (or head) j of tensor L is the node L@rb@cj (L@rb@hj)
ROW_MARK, COL_MARK, HEAD_MARK = "@r", "@c", "@h"


def window_rows(rows: Range, window: Sequence[int]) -> Range:
    """The input rows [r0, r1) that output rows [a, b) of a (kernel, stride, padding) window read,
    padding rows included: r0 < 0 and r1 past the input where the window runs over its edges."""
    k, s, p = window
    a, b = rows
    return a * s - p, (b - 1) * s - p + k


def receptive(rows: Range, window: Sequence[int], h_in: int) -> Range:
    """The input rows a window operator reads for output rows [a, b), within the input."""
    r0, r1 = window_rows(rows, window)
    return max(0, r0), min(h_in, r1)


def touching(rows: Range, window: Sequence[int], h_out: int) -> Range:
    """The output rows [m0, m1) whose windows read some of input rows [a, b)."""
    k, s, p = window
    a, b = rows
    return max(0, (a + p - k) // s + 1), min(h_out, (b + p - 1) // s + 1)


def partition(n: int, k: int) -> list[Range]:
    """k contiguous ranges covering 0..n, sizes differing by at most one (k capped at n): how strips
    cut rows, row tiling cuts tokens and features, and weight slices cut output features."""
    k = max(1, min(k, n))
    bounds = [round(n * j / k) for j in range(k + 1)]
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class TiledLayer:
    """One forward operator of a tiled graph, per sample: ``shape`` without the batch, ``inputs``
    by name. ``window`` (kernel, stride, padding) for convolutions and pooling; ``groups`` and
    ``bias`` for a convolution under strips (the zoo records neither); ``cls`` (a linear over the
    [CLS] token), ``positional`` (a position table) and ``divisor`` (what attention scores are
    divided by, where not sqrt(d_head)) under row tiling."""
    name: str
    op: str
    shape: tuple[int, ...]
    inputs: tuple[str, ...]
    params: int = 0
    window: tuple[int, ...] = ()
    groups: int = 1
    bias: bool = False
    cls: bool = False
    positional: bool = False
    divisor: float | None = None


@dataclass(frozen=True)
class NodeRecord:
    """What one node computes. ``role`` says which kind of work (forward, grad, wgrad, ...);
    ``layer`` the forward operator it computes, updates or normalises, ``of`` the tensor whose
    gradient a ``grad`` node computes; ``prev`` the node whose partial result it continues (a chain
    of sums); ``logits``: a gradient of the network's output (softmax minus target);
    ``update``: the link of a weight-gradient chain that applies the SGD update."""
    role: str
    layer: str | None = None
    of: str | None = None
    prev: str | None = None
    logits: bool = False
    update: bool = False

    @property
    def tensor(self) -> str | None:
        """The forward tensor this node computes a part of, or the gradient of."""
        return self.layer if self.layer is not None else self.of


@dataclass(frozen=True)
class StripRecord(NodeRecord):
    """A node of a strip graph: ``rows`` [a, b) of its tensor along H (None: the whole tensor);
    a ``grad`` node's ``terms`` (the users whose gradients it sums) and ``updates`` (the layers
    whose SGD update is fused into it)."""
    rows: Range | None = None
    terms: tuple[str, ...] = ()
    updates: tuple[str, ...] = ()


@dataclass(frozen=True)
class RowTerm:
    """One user's contribution to a row-tiled gradient link: ``kind`` names the backward rule
    (linear, layernorm, scores_q, context_v, ...), ``j`` the output piece of a linear user, ``b``
    the query block of an attention user."""
    kind: str
    layer: str
    j: int | None = None
    b: int | None = None


@dataclass(frozen=True)
class RowRecord(NodeRecord):
    """A node of a row-tiled graph: row block ``b``, column piece (or head) ``j``, input piece or
    layer-norm piece ``k``, vocabulary tile ``v``; a weight node's ``tile`` (output piece, input
    piece) or (piece,); a gradient link's ``terms``; an embedding update's row ``blocks``."""
    b: int | None = None
    j: int | None = None
    k: int | None = None
    v: int | None = None
    tile: tuple[int, ...] | None = None
    terms: tuple[RowTerm, ...] = ()
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class WeightTiles:
    """How row tiling cuts one layer's weights: ``kind`` linear (``rows`` output pieces by ``cols``
    input pieces), embedding (``vocab`` table rows by ``cols`` feature pieces) or norm (``cols``)."""
    kind: str
    cols: tuple[Range, ...]
    rows: tuple[Range, ...] = ()
    vocab: tuple[Range, ...] = ()


@dataclass(frozen=True)
class WeightSlices:
    """A layer whose weights were cut along its output ``features`` into slices, one layer each
    (``names``, in order), joined by a concat under the layer's name."""
    layer: str
    names: tuple[str, ...]
    features: int

    def ranges(self) -> dict[str, Range]:
        """Slice name -> the output features [lo, hi) it computes."""
        return dict(zip(self.names, partition(self.features, len(self.names))))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True, eq=False)
class Tiling:
    """The common part of a tiled graph's record: its forward operators and what every node
    computes."""
    layers: Mapping[str, TiledLayer]
    nodes: Mapping[str, NodeRecord]

    def ranges(self, name: str) -> dict[str, Range]:
        """Axis -> [lo, hi) of its tensor that node ``name`` covers; an axis it covers whole is
        left out."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False, kw_only=True)
class StripTiling(Tiling):
    """An activation-strip graph: ``tensors`` (tensor -> its row ranges, for the tensors in more
    than one strip), ``per_height`` (H as a string -> strips, where more than one), and
    ``grad_alias`` (weight slice -> the concat whose gradient strips it reads)."""
    tensors: Mapping[str, list[Range]] = field(default_factory=dict)
    per_height: Mapping[str, int] = field(default_factory=dict)
    grad_alias: Mapping[str, str] = field(default_factory=dict)

    def ranges(self, name: str) -> dict[str, Range]:
        rows = self.nodes[name].rows
        return {} if rows is None else {"H": tuple(rows)}

    def strips(self, layer: str) -> list[Range]:
        """The row ranges of a (C, H, W) tensor's strips: one, the whole height, when not split."""
        return [tuple(r) for r in self.tensors.get(layer) or [(0, self.layers[layer].shape[1])]]

    def striped(self, layer: str) -> bool:
        return layer in self.tensors

    def strip_name(self, layer: str, j: int, prefix: str = "") -> str:
        """The node of strip j of ``layer``, or of its gradient (prefix "grad:"), statistics ("stats:",
        "gstats:") and so on."""
        return f"{prefix}{layer}" if layer not in self.tensors else f"{prefix}{layer}{STRIP_MARK}{j}"

    def strip_index(self, layer: str, rows: Range) -> int:
        return self.strips(layer).index(tuple(rows))

    def chain_end(self, prefix: str, layer: str) -> str:
        """The last link of a chain over a layer's strips (batch norm's "stats:" and "gstats:"),
        which holds the whole tensor's sums."""
        return f"{prefix}{layer}{STRIP_MARK}{len(self.strips(layer)) - 1}"

    def pieces(self, layer: str, lo: int, hi: int) -> list[tuple[int, Range, Range]]:
        """The strips that hold rows [lo, hi) of ``layer`` (clipped to the tensor), in order: (j, the
        strip's rows [a, b), the rows [r0, r1) of [lo, hi) it holds)."""
        return [(j, (a, b), (max(lo, a), min(hi, b))) for j, (a, b) in enumerate(self.strips(layer))
                if max(lo, a) < min(hi, b)]


@dataclass(frozen=True, eq=False, kw_only=True)
class RowTiling(Tiling):
    """A row-tiled graph: the token ``blocks`` (the same for every tensor), ``piece`` (features
    per column piece), ``vocab_rows`` (table rows per embedding tile), ``cols`` (tensor -> its
    feature pieces) and ``tiles`` (layer -> how its weights are cut)."""
    blocks: Sequence[Range] = ()
    piece: int = 0
    vocab_rows: int = 0
    cols: Mapping[str, list[Range]] = field(default_factory=dict)
    tiles: Mapping[str, WeightTiles] = field(default_factory=dict)

    def ranges(self, name: str) -> dict[str, Range]:
        """"tokens" (a vector's one row: (0, 1)), and "features" or, for attention scores and
        probabilities, "heads"; a weight tile's node (param, wgrad, embed_update) says its ``tile``
        instead of features."""
        rec = self.nodes[name]
        lay = self.layers.get(rec.tensor)
        if lay is None:
            return {}
        out: dict[str, Range] = {}
        if rec.b is not None:
            vector = len(lay.shape) == 1 and lay.op != "input"
            out["tokens"] = (0, 1) if vector else tuple(self.blocks[rec.b])
        piece = rec.k if rec.role in ("ln_stats", "ln_gstats") else rec.j
        if piece is not None and rec.role not in ("param", "wgrad", "embed_update"):
            heads = lay.op == "softmax" or lay.op == "matmul" and len(lay.shape) == 3
            out["heads" if heads else "features"] = tuple(self.cols[lay.name][piece])
        return out

    def vector(self, layer: str) -> bool:
        """One row per sample (a pooled or [CLS] vector), not one per token."""
        lay = self.layers[layer]
        return len(lay.shape) == 1 and lay.op != "input"

    def heads(self, layer: str) -> bool:
        """Attention scores and probabilities: pieces are heads, each as wide as the sequence."""
        lay = self.layers[layer]
        return lay.op == "softmax" or lay.op == "matmul" and len(lay.shape) == 3

    def tile_name(self, layer: str, b: int, j: int, prefix: str = "") -> str:
        """The node of row block b, piece j of ``layer`` (or of its gradient, prefix "grad:")."""
        return f"{prefix}{layer}{ROW_MARK}{b}{HEAD_MARK if self.heads(layer) else COL_MARK}{j}"

    def chain_end(self, prefix: str, layer: str, b: int) -> str:
        """The last link of a layer norm's chain over the pieces of row block b ("lnstats:",
        "lngstats:"), which holds the whole rows' sums."""
        return f"{prefix}{layer}{ROW_MARK}{b}{COL_MARK}{len(self.cols[layer]) - 1}"

    def pieces(self, layer: str, lo: int, hi: int) -> list[tuple[int, Range, Range]]:
        """The feature pieces that hold columns [lo, hi) of ``layer``, in order: (j, the piece's
        columns [a, c), the columns [r0, r1) of [lo, hi) it holds)."""
        return [(j, (a, c), (max(lo, a), min(hi, c))) for j, (a, c) in enumerate(self.cols[layer])
                if max(lo, a) < min(hi, c)]

    def head_dim(self, scores: str) -> int:
        return self.layers[self.layers[scores].inputs[0]].shape[-1] // self.layers[scores].shape[0]

    def divisor(self, scores: str) -> float:
        """What attention scores are divided by: the model's own, else the square root of the head's width."""
        return self.layers[scores].divisor or math.sqrt(self.head_dim(scores))

    def tile_ranges(self, layer: str, tile: Sequence[int]) -> dict[str, tuple[Range, ...]]:
        """role -> the ranges, per axis, of the layer's parameter that weight tile ``tile`` is: a
        linear layer's (output piece, input piece) block of its weight, and of its bias in the first
        input piece; a norm's piece of gamma and beta; an embedding's (vocabulary rows, feature
        piece) block of its table."""
        kind = self.tiles[layer].kind
        if kind == "linear":
            out, inp = self.cols[layer][tile[0]], self.cols[self.layers[layer].inputs[0]][tile[1]]
            return {"weight": (tuple(out), tuple(inp)), **({"bias": (tuple(out),)} if tile[1] == 0 else {})}
        if kind == "norm":
            piece = tuple(self.cols[layer][tile[0]])
            return {"weight": (piece,), "bias": (piece,)}
        return {"weight": (tuple(self.tiles[layer].vocab[tile[0]]), tuple(self.cols[layer][tile[1]]))}
