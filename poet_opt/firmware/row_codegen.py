"""The C of a schedule of a row-tiled transformer graph (poet_opt/model/rows.py, docs/streaming.md,
"Row tiling").

Each node of a row graph computes one block of tokens by one piece of features of one tensor (a
head's block of scores, a layer norm's statistics, a link of a partial sum), and
``graph.meta["rows"].nodes`` records what: the generator reads that record, as
poet_opt/executor/rows.py does in PyTorch, and emits the same maths on the tiles the plan holds in
the arena, each laid out [batch][block][piece]:

- the registry's elementwise operators (add, GELU, ...) go piece by piece with their C kernels
  (OpSpec.c_forward, c_backward), as whole tensors and strips do;
- a linear layer's link is the whole-tensor kernel on one input piece and one weight tile (its
  region holds the tile's weights [out piece][in piece], then its bias in the first input piece's
  tile), added to the previous link; its data and weight gradients likewise, the last weight-
  gradient link folding its part into the sum so far, applying ``w -= lr * g`` to the tile in the
  arena and writing the tile back, as a streamed layer's update does;
- attention's scores, context and their gradients are sums of products of sub-matrices of tiles (a
  head's columns of a piece, a block's columns of a score row): ``poet_gemm`` reads each in place
  with its strides, one call per part, so nothing is gathered into scratch RAM;
- layer norm chains its statistics and its backward's sums over the pieces of each block and
  normalises each piece from the last link; a mean over tokens sums block by block
  (poet_kernels_rows.c).

What the generator runs is the support table's "rows" column (model/ops/support.py);
``check_rows`` refuses anything else before a plan is solved.
"""

from __future__ import annotations

from poet_opt.errors import PoetError
from poet_opt.firmware.writer import LR, StepWriter, c_float, elementwise_backward, ids
from poet_opt.model import ops as registry
from poet_opt.model.network import Layer, Parameter
from poet_opt.model.ops import support

FIELD = "--strips"  # the option that asks for row tiles


def check_rows(network) -> None:
    """Refuse, naming the node and --strips, a row-tiled network with an operator the firmware has no
    row kernel for (before anything is solved)."""
    graph = network.graph
    if graph is None:
        return
    missing = [f"node {name!r} ({lay.op})" for name, lay in graph.meta["rows"].layers.items()
               if lay.op != "input" and not support.runs(registry.spec(lay.op), "rows", "firmware")]
    if missing:  # every one at once, so that a fix is not followed by the next refusal
        them = "them" if len(missing) > 1 else "it"
        raise PoetError(f"{', '.join(missing)}: the firmware has no row-tile kernel for {them}; it runs "
                        f"{', '.join(sorted(firmware_row_ops()))} in row tiles", field=FIELD)
    layers = graph.meta["rows"].layers
    logits = list(layers)[-1]
    if len(layers[logits].shape) != 1 or len(graph.meta["rows"].cols[logits]) != 1:
        raise PoetError(f"node {logits!r}: the firmware runs row tiles of a classifier, whose logits are one "
                        "vector (a head on pooled tokens), not per-token logits", field=FIELD)


def firmware_row_ops() -> set[str]:
    return {s.name for s in registry.specs() if s.name not in support.STRUCTURAL
            and support.runs(s, "rows", "firmware")}


class RowWriter(StepWriter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_rows(self.net)
        self.tiling = tiling = self.net.graph.meta["rows"]
        self.blocks = [tuple(b) for b in tiling.blocks]
        self.layers_meta, self.records, self.tiles = tiling.layers, tiling.nodes, tiling.tiles
        self.cols = {name: [tuple(c) for c in cs] for name, cs in tiling.cols.items()}
        self.seq = self.blocks[-1][1]
        self.batch = self.net.input_shape[0]
        self.scratch_floats = 0
        self.positions = False  # a table indexed by position reads poet_positions

    # -- weights ---------------------------------------------------------------------------------

    def weight_regions(self) -> dict[int, Layer]:
        """Each ``param:L#tile`` node's region: the tile's block of L's weight (and its bias, in a
        linear layer's first input piece, as executor/rows.py cuts them), a layer of its own whose
        parameters say which part of the torch parameters they are."""
        tiling = self.net.graph.meta["rows"]
        out: dict[int, Layer] = {}
        for n, node in enumerate(self.nodes):
            if node.get("op") != "param":
                continue
            name, _, tile = str(node["name"])[len("param:"):].rpartition("#")
            layer = self.net.layers.get(name)
            kind = tiling.tiles[name].kind if name in tiling.tiles else None
            if layer is None or kind not in ("linear", "norm", "embedding"):
                raise PoetError(f"node {node['name']!r}: the firmware streams row tiles of linear layers, layer "
                                "norms and embeddings only", field=FIELD)
            index = tuple(int(t) for t in tile.split("."))
            w, b = layer.params["weight"], layer.params.get("bias")
            # (output piece x input piece) of a linear weight and its bias, a norm's piece, or
            # (vocabulary rows x feature piece) of an embedding's table
            params = {}
            for role, ranges in tiling.tile_ranges(name, index).items():
                whole = w if role == "weight" else b
                rows, *cols = ranges
                part = whole.value[tuple(slice(lo, hi) for lo, hi in ranges)].copy()
                params[role] = Parameter(whole.torch_name, part, rows, whole.value.shape, *cols)
            region = Layer(str(node["name"]), layer.op, layer.shape, [], [], dict(layer.attrs), params,
                           trainable=layer.trainable)
            if 4 * sum(p.value.size for p in params.values()) != int(node["bytes"]):
                raise PoetError(f"internal: {node['name']!r} is {node['bytes']} B in the graph but its tile has "
                                f"{sum(p.value.size for p in params.values())} floats")
            out[n] = region
        return out

    def declare(self) -> None:
        """Nothing per layer: weights stream through the arena, and the norms' statistics are
        nodes of the graph there too."""

    def finish(self, lines: list[str]) -> None:
        if self.scratch_floats:  # a single block's norm gradient, before its update (wgrad); a table tile's
            self.decls.append(f"static float poet_scratch[{self.scratch_floats}];\n")
        if self.positions:  # the ids of a position table: 0 .. seq-1
            self.decls.append(f"static const int32_t poet_positions[{self.seq}] = {{"
                              f"{', '.join(str(t) for t in range(self.seq))}}};\n")

    def logits_step(self) -> int:
        want = self.by_name[self.tiling.tile_name(list(self.layers_meta)[-1], 0, 0)]
        for s, step in enumerate(self.doc["steps"]):
            if step["op"] == "compute" and step["node"] == want:
                return s
        raise PoetError("internal: the schedule never computes the logits")

    # -- layout ----------------------------------------------------------------------------------




    def rows(self, layer: str, b: int) -> int:
        """Rows per sample of block b of the layer's tiles (a vector's: one)."""
        r0, r1 = self.blocks[b]
        return 1 if self.tiling.vector(layer) else r1 - r0

    def width(self, layer: str, j: int) -> int:
        if self.tiling.heads(layer):
            return self.seq
        c0, c1 = self.cols[layer][j]
        return c1 - c0

    def count(self, layer: str, b: int, j: int) -> int:
        return self.batch * self.rows(layer, b) * self.width(layer, j)

    def tile(self, ops, layer: str, b: int, j: int, prefix: str = "") -> str:
        return self.at(ops, self.tiling.tile_name(layer, b, j, prefix), f"a tile of {prefix}{layer}")

    def weights(self, ops, layer: str, tile) -> tuple[str, str]:
        """(the weight, the bias or NULL) of a tile in the arena: the bias after the weights."""
        name = f"param:{layer}#{'.'.join(map(str, tile))}"
        base = self.at(ops, name, f"{layer}'s weights")
        if self.tiles[layer].kind == "embedding":
            return base, "NULL"
        if self.tiles[layer].kind == "norm":
            return base, f"{base} + {self.width(layer, tile[0])}u"
        o = self.width(layer, tile[0])
        i = self.width(self.layers_meta[layer].inputs[0], tile[1])
        return base, f"{base} + {o * i}u" if tile[1] == 0 else "NULL"

    def overlap(self, layer: str, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(piece, first, last column) of the layer's pieces that hold columns [lo, hi)."""
        return [(j, r0, r1) for j, _, (r0, r1) in self.tiling.pieces(layer, lo, hi)]



    def eps(self, layer: str) -> str:
        return c_float(self.net.layers[layer].attrs.get("eps", 1e-5))

    def stats(self, ops, layer: str, b: int, kind: str = "lnstats") -> str:
        return self.at(ops, self.tiling.chain_end(f"{kind}:", layer, b), f"{layer}'s block {b}")

    @staticmethod
    def gemm(c: str, ldc: int, a: str, a_strides, b: str, b_strides, m: int, n: int, k: int,
             alpha: float = 1.0) -> str:
        return (f"poet_gemm({c}, {ldc}u, {a}, {a_strides[0]}u, {a_strides[1]}u, {b}, {b_strides[0]}u, "
                f"{b_strides[1]}u, {m}u, {n}u, {k}u, {c_float(alpha)});")

    # -- nodes -----------------------------------------------------------------------------------

    def compute(self, node: int, info: dict, out: str, ops: dict[int, int], first: bool) -> list[str]:
        rec = self.records[info["name"]]
        role = rec.role
        if role == "param":
            return super().compute(node, info, out, ops, first)
        handler = {"forward": self.forward_tile, "scores": self.scores, "context": self.context, "mean": self.mean,
                   "linear": self.linear, "ln_stats": self.ln_stats, "ln_gstats": self.ln_gstats,
                   "loss": self.loss, "grad": self.gradient, "wgrad": self.wgrad, "embed": self.embed,
                   "embed_update": self.embed_update}.get(role)
        if handler is None:
            raise PoetError(f"node {info['name']!r}: the firmware has no row-tile kernel for it ({role})", field=FIELD)
        lines = handler(rec, out, ops)
        if role == "loss" and first:
            lines.append(f"*loss = {out}[0];")
        for p in info.get("updates", ()):  # the last weight-gradient link: the tile back to its region
            lines += [f"rc = poet_page_out({self.flash.offsets[p]}u, (poet_arena + {ops[p] // 4}u), "
                      f"{int(self.nodes[p]['bytes'])}u);", "if (rc) return rc;"]
        return lines

    def forward_tile(self, rec, out, ops) -> list[str]:
        layer, b, j = rec.layer, rec.b, rec.j
        lay = self.layers_meta[layer]
        op, inputs = lay.op, lay.inputs
        n, rows, w = self.batch, self.rows(layer, b), self.width(layer, j)
        if op == "input":  # the block's rows of the piece's features (or its token ids), sample by sample
            d = lay.shape[-1] if len(lay.shape) > 1 else 1
            r0, _ = self.blocks[b]
            c0, _ = self.cols[layer][j]
            return [f"poet_copy_strided({out} + {s * rows * w}u, poet_input + {(s * self.seq + r0) * d + c0}u, "
                    f"{rows}u, {w}u, {w}u, {d}u);" for s in range(n)]
        x = self.tile(ops, inputs[0], b, j)
        if op == "layernorm":
            gamma, beta = self.weights(ops, layer, (j,))
            return [f"poet_layernorm_rows_forward({out}, {x}, {self.stats(ops, layer, b)}, {gamma}, {beta}, "
                    f"{n * rows}u, {w}u, {lay.shape[-1]}u, {self.eps(layer)});"]
        if op == "softmax":
            return [f"poet_softmax_forward({out}, {x}, {n * rows}u, {self.seq}u);"]
        xs = ", ".join(self.tile(ops, i, b, j) for i in inputs)  # add, GELU, ...: the registry's kernel
        return [f"{registry.spec(op).c_forward}({out}, {xs}, {self.count(layer, b, j)}u);"]

    def scores(self, rec, out, ops) -> list[str]:
        """Head h's scores of block b, Q K^T / divisor, summed over the parts of the head's columns
        (Q's pieces) and the key blocks (K's tiles), each product in place."""
        layer, b, h = rec.layer, rec.b, rec.j
        q, k = self.layers_meta[layer].inputs
        dh, rows = self.tiling.head_dim(layer), self.rows(layer, b)
        lines = [f"poet_zero({out}, {self.count(layer, b, h)}u);"]
        for s in range(self.batch):
            c = f"{out} + {s * rows * self.seq}u"
            for jq, lo, hi in self.overlap(q, h * dh, (h + 1) * dh):
                wq = self.width(q, jq)
                a = f"{self.tile(ops, q, b, jq)} + {s * rows * wq + lo - self.cols[q][jq][0]}u"
                for bk, (k0, k1) in enumerate(self.blocks):
                    for jk, lo2, hi2 in self.overlap(k, lo, hi):
                        wk = self.width(k, jk)
                        kb = f"{self.tile(ops, k, bk, jk)} + {s * (k1 - k0) * wk + lo2 - self.cols[k][jk][0]}u"
                        qa = f"{a} + {lo2 - lo}u"
                        lines.append(self.gemm(f"{c} + {k0}u", self.seq, qa, (wq, 1), kb, (1, wk), rows, k1 - k0,
                                               hi2 - lo2, 1.0 / self.tiling.divisor(layer)))
        return lines

    def context(self, rec, out, ops) -> list[str]:
        """Piece j of block b of P V: per head in the piece, its probabilities times V's rows of every
        block, in V's pieces."""
        layer, b, j = rec.layer, rec.b, rec.j
        p, v = self.layers_meta[layer].inputs
        dh, rows, w = self.tiling.head_dim(self.layers_meta[p].inputs[0]), self.rows(layer, b), self.width(layer, j)
        c0, c1 = self.cols[layer][j]
        lines = [f"poet_zero({out}, {self.count(layer, b, j)}u);"]
        for s in range(self.batch):
            for h in range(c0 // dh, (c1 - 1) // dh + 1):
                probs = f"{self.tile(ops, p, b, h)} + {s * rows * self.seq}u"
                for bv, (v0, v1) in enumerate(self.blocks):
                    for jv, lo, hi in self.overlap(v, max(c0, h * dh), min(c1, (h + 1) * dh)):
                        wv = self.width(v, jv)
                        vb = f"{self.tile(ops, v, bv, jv)} + {s * (v1 - v0) * wv + lo - self.cols[v][jv][0]}u"
                        lines.append(self.gemm(f"{out} + {s * rows * w + lo - c0}u", w, f"{probs} + {v0}u",
                                               (self.seq, 1), vb, (wv, 1), rows, hi - lo, v1 - v0))
        return lines

    def mean(self, rec, out, ops) -> list[str]:
        layer, b, j = rec.layer, rec.b, rec.j
        x = self.layers_meta[layer].inputs[0]
        w = self.width(layer, j)
        start = f"poet_copy({out}, {self.at(ops, rec.prev, rec.prev)}, {self.batch * w}u);" if rec.prev \
            else f"poet_zero({out}, {self.batch * w}u);"
        return [start, f"poet_rows_mean_forward({out}, {self.tile(ops, x, b, j)}, {self.batch}u, {self.rows(x, b)}u, "
                       f"{w}u, {self.seq}u);"]

    def linear_rows(self, layer: str, b: int, x: str, k: int):
        """(sample strides of the layer's input tile and output tile, rows per call, calls): the
        pooler reads its input's first row only, sample by sample."""
        cls = self.layers_meta[layer].cls
        xb = 0 if cls else b
        wx = self.width(x, k)
        if cls and self.batch > 1:
            return [(s * self.rows(x, xb) * wx, s) for s in range(self.batch)], 1
        return [(0, 0)], self.batch * (1 if cls else self.rows(layer, b))

    def linear(self, rec, out, ops) -> list[str]:
        layer, b, j, k = rec.layer, rec.b, rec.j, rec.k
        x = self.layers_meta[layer].inputs[0]
        cls = self.layers_meta[layer].cls
        w, bias = self.weights(ops, layer, (j, k))
        wo, wi = self.width(layer, j), self.width(x, k)
        xt = self.tile(ops, x, 0 if cls else b, k)
        calls, rows = self.linear_rows(layer, b, x, k)
        lines = [f"poet_linear_forward({out} + {s * wo}u, {xt} + {at}u, {w}, {bias}, {rows}u, {wi}u, {wo}u);"
                 for at, s in calls]
        if rec.prev:
            lines.append(f"poet_accumulate({out}, {self.at(ops, rec.prev, rec.prev)}, "
                         f"{self.count(layer, b, j)}u);")
        return lines

    def token_ids(self, ops, layer: str, b: int) -> list[tuple[str, int, int]]:
        """(int32 ids, count, the sample's first row of the block's tile) of block b as an embedding
        reads them: the block's token ids, all samples at once; or, for a table indexed by position,
        the block's positions, sample by sample (``poet_positions``, 0 .. seq-1, in flash)."""
        r0, r1 = self.blocks[b]
        if self.layers_meta[layer].positional:
            self.positions = True
            return [(f"poet_positions + {r0}u", r1 - r0, s * (r1 - r0)) for s in range(self.batch)]
        return [(ids(self.tile(ops, self.layers_meta[layer].inputs[0], b, 0)), self.batch * (r1 - r0), 0)]

    def embed(self, rec, out, ops) -> list[str]:
        """Tile (b, j) of an embedding's output, one table tile (vocabulary rows v0..v1) at a time:
        the rows of the ids the tile holds, over the tiles before (each token's row is in one)."""
        layer, b, j, v = rec.layer, rec.b, rec.j, rec.v
        (v0, v1), w = self.tiles[layer].vocab[v], self.width(layer, j)
        table, _ = self.weights(ops, layer, (v, j))
        lines = [f"poet_copy({out}, {self.at(ops, rec.prev, rec.prev)}, {self.count(layer, b, j)}u);" if rec.prev
                 else f"poet_zero({out}, {self.count(layer, b, j)}u);"]
        return lines + [f"poet_embedding_forward({out} + {row * w}u, {at}, {table}, {count}u, {v0}u, {v1 - v0}u, {w}u);"
                        for at, count, row in self.token_ids(ops, layer, b)]

    def embed_update(self, rec, out, ops) -> list[str]:
        """A table tile's SGD step: its rows' gradient summed over the blocks that read it, in
        scratch RAM, then ``w -= lr * g`` (rows no token picked stay as they are)."""
        layer, v, j = rec.layer, rec.v, rec.j
        (v0, v1), w = self.tiles[layer].vocab[v], self.width(layer, j)
        table, _ = self.weights(ops, layer, (v, j))
        total = (v1 - v0) * w
        self.scratch_floats = max(self.scratch_floats, total)
        lines = [f"poet_zero(poet_scratch, {total}u);"]
        for b in rec.blocks:
            g = self.tile(ops, layer, b, j, "grad:")
            lines += [f"poet_embedding_backward_params(poet_scratch, {g} + {row * w}u, {at}, {count}u, {v0}u, "
                      f"{v1 - v0}u, {w}u);" for at, count, row in self.token_ids(ops, layer, b)]
        return lines + [f"poet_sgd_step({table}, poet_scratch, {total}u, {LR});"]

    def ln_stats(self, rec, out, ops) -> list[str]:
        layer, b, k = rec.layer, rec.b, rec.k
        x = self.layers_meta[layer].inputs[0]
        prev = self.at(ops, rec.prev, rec.prev) if rec.prev else "NULL"
        return [f"poet_layernorm_rows_stats({out}, {prev}, {self.tile(ops, x, b, k)}, "
                f"{self.batch * self.rows(x, b)}u, {self.width(x, k)}u, {self.cols[layer][k][0]}u);"]

    def ln_gstats(self, rec, out, ops) -> list[str]:
        layer, b, k = rec.layer, rec.b, rec.k
        x = self.layers_meta[layer].inputs[0]
        prev = self.at(ops, rec.prev, rec.prev) if rec.prev else "NULL"
        gamma, _ = self.weights(ops, layer, (k,))
        return [f"poet_layernorm_rows_grad_stats({out}, {prev}, {self.tile(ops, layer, b, k, 'grad:')}, "
                f"{self.tile(ops, x, b, k)}, {self.stats(ops, layer, b)}, {gamma}, {self.batch * self.rows(x, b)}u, "
                f"{self.width(x, k)}u, {self.layers_meta[layer].shape[-1]}u, {self.eps(layer)});"]

    def loss(self, rec, out, ops) -> list[str]:
        logits = list(self.layers_meta)[-1]  # one vector tile (check_rows)
        classes = self.layers_meta[logits].shape[-1]
        return [f"poet_cross_entropy_forward({out}, {self.tile(ops, logits, 0, 0)}, poet_labels, {self.batch}u, "
                f"{classes}u);"]

    # -- gradients -------------------------------------------------------------------------------

    def gradient(self, rec, out, ops) -> list[str]:
        f, b, j = rec.of, rec.b, rec.j
        n = self.count(f, b, j)
        lines = [f"poet_copy({out}, {self.at(ops, rec.prev, rec.prev)}, {n}u);" if rec.prev
                 else f"poet_zero({out}, {n}u);"]
        if rec.logits:
            lines.append(f"poet_cross_entropy_backward({out}, {self.tile(ops, f, 0, 0)}, poet_labels, {self.batch}u, "
                         f"{self.layers_meta[f].shape[-1]}u);")
        for term in rec.terms:
            lines += self.term(term, f, b, j, out, ops)
        return lines

    def term(self, term: dict, f: str, b: int, j: int, out: str, ops) -> list[str]:
        """out += the data gradient back through the term's layer into tile (b, j) of f."""
        kind, u = term.kind, term.layer
        lay = self.layers_meta[u]
        n, rows, w = self.batch, self.rows(f, b), self.width(f, j)
        if kind == "linear":
            jj = term.j
            g = self.tile(ops, u, 0 if lay.cls or self.tiling.vector(u) else b, jj, "grad:")
            weight, _ = self.weights(ops, u, (jj, j))
            wo = self.width(u, jj)
            if lay.cls:  # the pooler read each sample's first token only
                return [f"poet_linear_backward_input({out} + {s * rows * w}u, {g} + {s * wo}u, {weight}, 1u, {w}u, "
                        f"{wo}u);" for s in range(n)]
            return [f"poet_linear_backward_input({out}, {g}, {weight}, {n * rows}u, {w}u, {wo}u);"]
        if kind == "mean":
            return [f"poet_rows_mean_backward({out}, {self.tile(ops, u, 0, j, 'grad:')}, {n}u, {rows}u, {w}u, "
                    f"{self.seq}u);"]
        if kind == "layernorm":
            gamma, _ = self.weights(ops, u, (j,))
            return [f"poet_layernorm_rows_backward({out}, {self.tile(ops, u, b, j, 'grad:')}, "
                    f"{self.tile(ops, f, b, j)}, {self.stats(ops, u, b)}, {self.stats(ops, u, b, 'lngstats')}, "
                    f"{gamma}, {n * rows}u, {w}u, {lay.shape[-1]}u, {self.eps(u)});"]
        if kind == "softmax":
            return [f"poet_softmax_backward({out}, {self.tile(ops, u, b, j, 'grad:')}, {self.tile(ops, u, b, j)}, "
                    f"{n * rows}u, {self.seq}u);"]
        if kind in ("scores_q", "scores_k"):
            return self.scores_gradient(term, f, b, j, out, ops)
        if kind in ("context_p", "context_v"):
            return self.context_gradient(term, f, b, j, out, ops)
        if registry.get(kind) is not None and registry.get(kind).c_backward:  # add, GELU, ...: one call an operand
            return [elementwise_backward(kind, out, self.tile(ops, u, b, j, "grad:"), self.count(f, b, j),
                                         lambda x: self.tile(ops, x, b, j), u, lay.inputs)
                    for x in lay.inputs if x == f]
        raise PoetError(f"node {u!r}: the firmware has no row-tile gradient for {kind}", field=FIELD)

    def scores_gradient(self, term, f: str, b: int, j: int, out: str, ops) -> list[str]:
        """dQ of block b: dS K / divisor; dK of block b: dS^T Q / divisor over the query block
        ``term.b``'s rows of dS that are block b's keys."""
        u = term.layer
        q, k = self.layers_meta[u].inputs
        dh, alpha = self.tiling.head_dim(u), 1.0 / self.tiling.divisor(u)
        rows, w = self.rows(f, b), self.width(f, j)
        c0, c1 = self.cols[f][j]
        lines = []
        for s in range(self.batch):
            for h in range(c0 // dh, (c1 - 1) // dh + 1):
                lo, hi = max(c0, h * dh), min(c1, (h + 1) * dh)
                c = f"{out} + {s * rows * w + lo - c0}u"
                if term.kind == "scores_q":
                    ds = f"{self.tile(ops, u, b, h, 'grad:')} + {s * rows * self.seq}u"
                    for bk, (k0, k1) in enumerate(self.blocks):
                        for jk, lo2, hi2 in self.overlap(k, lo, hi):
                            wk = self.width(k, jk)
                            kb = f"{self.tile(ops, k, bk, jk)} + {s * (k1 - k0) * wk + lo2 - self.cols[k][jk][0]}u"
                            lines.append(self.gemm(f"{c} + {lo2 - lo}u", w, f"{ds} + {k0}u", (self.seq, 1), kb,
                                                   (wk, 1), rows, hi2 - lo2, k1 - k0, alpha))
                else:
                    bq = term.b
                    r0, _ = self.blocks[b]
                    rq = self.rows(q, bq)
                    ds = f"{self.tile(ops, u, bq, h, 'grad:')} + {s * rq * self.seq + r0}u"
                    for jq, lo2, hi2 in self.overlap(q, lo, hi):
                        wq = self.width(q, jq)
                        qb = f"{self.tile(ops, q, bq, jq)} + {s * rq * wq + lo2 - self.cols[q][jq][0]}u"
                        lines.append(self.gemm(f"{c} + {lo2 - lo}u", w, ds, (1, self.seq), qb, (wq, 1), rows,
                                               hi2 - lo2, rq, alpha))
        return lines

    def context_gradient(self, term, f: str, b: int, j: int, out: str, ops) -> list[str]:
        """dP of block b, head j: dC V^T over the head's columns; dV of block b: P^T dC over the
        query block ``term.b``'s probabilities of block b's keys."""
        u = term.layer
        p, v = self.layers_meta[u].inputs
        dh = self.tiling.head_dim(self.layers_meta[p].inputs[0])
        rows = self.rows(f, b)
        lines = []
        for s in range(self.batch):
            if term.kind == "context_p":  # f is P, j a head
                for jc, lo, hi in self.overlap(u, j * dh, (j + 1) * dh):
                    wc = self.width(u, jc)
                    dc = f"{self.tile(ops, u, b, jc, 'grad:')} + {s * rows * wc + lo - self.cols[u][jc][0]}u"
                    for bv, (v0, v1) in enumerate(self.blocks):
                        for jv, lo2, hi2 in self.overlap(v, lo, hi):
                            wv = self.width(v, jv)
                            vb = f"{self.tile(ops, v, bv, jv)} + {s * (v1 - v0) * wv + lo2 - self.cols[v][jv][0]}u"
                            lines.append(self.gemm(f"{out} + {s * rows * self.seq + v0}u", self.seq,
                                                   f"{dc} + {lo2 - lo}u", (wc, 1), vb, (1, wv), rows, v1 - v0,
                                                   hi2 - lo2))
                continue
            bq = term.b
            r0, _ = self.blocks[b]
            rq, w = self.rows(u, bq), self.width(f, j)
            c0, c1 = self.cols[f][j]
            for h in range(c0 // dh, (c1 - 1) // dh + 1):
                probs = f"{self.tile(ops, p, bq, h)} + {s * rq * self.seq + r0}u"
                for jc, lo, hi in self.overlap(u, max(c0, h * dh), min(c1, (h + 1) * dh)):
                    wc = self.width(u, jc)
                    dc = f"{self.tile(ops, u, bq, jc, 'grad:')} + {s * rq * wc + lo - self.cols[u][jc][0]}u"
                    lines.append(self.gemm(f"{out} + {s * rows * w + lo - c0}u", w, probs, (1, self.seq), dc,
                                           (wc, 1), rows, hi - lo, rq))
        return lines

    # -- weights ---------------------------------------------------------------------------------

    def wgrad(self, rec, out, ops) -> list[str]:
        """One link of a tile's weight-gradient chain over the row blocks: block b's part added to
        the sum so far; the last folds it into the tile in the arena (``w -= lr * g``)."""
        layer, tile, b = rec.layer, tuple(rec.tile), rec.b
        lay = self.layers_meta[layer]
        x = lay.inputs[0]
        # the tile itself is an operand of the last link only, which updates it
        w, bias = self.weights(ops, layer, tile) if rec.update else ("NULL", "NULL")
        j = tile[0]
        wo = self.width(layer, j)
        total = wo * (2 if lay.op == "layernorm" else self.width(x, tile[1]) + (1 if tile[1] == 0 else 0))
        prev = self.at(ops, rec.prev, rec.prev) if rec.prev else None
        g = self.tile(ops, layer, 0 if self.tiling.vector(layer) else b, j, "grad:")
        lines = []
        if rec.update and prev is None and lay.op == "linear" and not (lay.cls and self.batch > 1):
            # a single link: the gradient straight into the weights, with no buffer for it
            calls, rows = self.linear_rows(layer, b, x, tile[1])
            xt = self.tile(ops, x, 0 if lay.cls else b, tile[1])
            return [f"poet_linear_backward_params_sgd({w}, {bias}, {g}, {xt}, {rows}u, {self.width(x, tile[1])}u, "
                    f"{wo}u, {LR});"]
        if not rec.update:
            into = out
            lines.append(f"poet_copy({out}, {prev}, {total}u);" if prev else f"poet_zero({out}, {total}u);")
        elif prev is not None:
            into = prev  # the sum so far, which nothing reads after this link, takes the last part
        else:
            into = "poet_scratch"
            self.scratch_floats = max(self.scratch_floats, total)
            lines.append(f"poet_zero({into}, {total}u);")
        if lay.op == "layernorm":
            n = self.batch * self.rows(x, b)
            lines.append(f"poet_layernorm_rows_backward_params({into}, {into} + {wo}u, {g}, {self.tile(ops, x, b, j)}, "
                         f"{self.stats(ops, layer, b)}, {n}u, {wo}u, {lay.shape[-1]}u, {self.eps(layer)});")
        else:
            k = tile[1]
            wi = self.width(x, k)
            xt = self.tile(ops, x, 0 if lay.cls else b, k)
            gb = f"{into} + {wo * wi}u" if k == 0 else "NULL"
            calls, rows = self.linear_rows(layer, b, x, k)
            lines += [f"poet_linear_backward_params({into}, {gb}, {g} + {s * wo}u, {xt} + {at}u, {rows}u, {wi}u, "
                      f"{wo}u);" for at, s in calls]
        if rec.update:
            lines.append(f"poet_sgd_step({w}, {into}, {total}u, {LR});")
        return lines
