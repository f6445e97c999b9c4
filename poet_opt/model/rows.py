"""Row tiling: the training graph of a zoo transformer whose (seq, d) tensors are split into blocks
of tokens (rows) and pieces of features (columns), so that no node holds a whole activation, its
gradient or a layer's weights (docs/streaming.md, "Row tiling").

A tensor of shape (seq, w) is a grid of nodes ``T@r{b}@c{j}``: row block b (the same blocks for
every tensor) by column piece j (pieces of at most ``piece`` features). Every weight matrix is cut
into tiles of (output piece x input piece), ``param:L#j.k``, and an embedding table into tiles of
(vocabulary rows x column piece), ``param:L#v.j``. The maths is the untiled model's:

- token-wise operators (add, GELU, tanh) go piece by piece;
- a linear layer's output piece over a row block sums its input pieces one tile at a time in a
  chain of partial sums, each link reading one input piece and one weight tile; its data gradient
  into an input piece sums the output pieces' contributions the same way; its weight gradient sums
  over row blocks (``wgrad:L#j.k@r{b}``), and the last link applies the fused SGD update, after
  the data-gradient link of every row block that read the old tile (it depends on them), so the
  update comes after every read of the old weights in any execution order;
- layer norm is per token: a chain over the pieces of a row block merges each piece's mean and
  squared deviations (Chan et al.) into ``lnstats:L@r{b}``; its backward sums g*gamma and
  g*gamma*xhat over the pieces in ``lngstats:L@r{b}``; gamma and beta are tiled per piece;
- attention per (row block, head): the scores of a block read its Q rows and the head's K over
  every token, softmax goes row by row, the context reads the probabilities and the head's V over
  every token; the gradients of K and V sum over the query blocks in chains;
- an embedding's output sums, one table tile at a time, the rows its token ids pick (positions
  for the position table); its update is sparse (the rows of the tokens seen) and needs no
  accumulator: one node per tile reads the tile and the output gradient of every token;
- the pooler reads the [CLS] token only; nodes that feed nothing (the last block's other tokens)
  are left out, and their gradients, zero, with them.

``graph.meta["rows"]``, a :class:`~poet_opt.model.tiling_records.RowTiling`, records what every
node computes (a ``RowRecord``), for the executor (executor/rows.py), the firmware generator
(firmware/row_codegen.py) and the tests that replay it against PyTorch's autograd.
"""

from __future__ import annotations

import math
from typing import Sequence

from poet_opt.errors import PoetError
from poet_opt.model import ops as registry
from poet_opt.model.graph import Node, TrainingGraph
from poet_opt.model.strips import first_node_of
from poet_opt.model.tiling_records import RowRecord, RowTerm, RowTiling, TiledLayer, WeightTiles, partition

ROW_MARK, COL_MARK, HEAD_MARK = "@r", "@c", "@h"
# elementwise operators (the registry's) go piece by piece: block b, feature piece j of the output
# reads the same piece of each input
TOKENWISE = tuple(n for n in registry.names(split="elementwise", tiling="rows") if n != "input")
ROW_OPS = ("input", "embedding", "linear", "layernorm", "matmul", "softmax", "avgpool", *TOKENWISE)


def pieces(width: int, piece: int) -> list[tuple[int, int]]:
    return partition(width, math.ceil(width / piece))


def _overlap(parts, lo: int, hi: int) -> list[int]:
    return [j for j, (a, b) in enumerate(parts) if a < hi and lo < b]


def is_transformer(ops: Sequence) -> bool:
    """Zoo models whose activations are (seq, d) token rows: the ones row tiling is for."""
    return any(o.op == "matmul" for o in ops) and all(o.op in ROW_OPS for o in ops)


class _Builder:
    def __init__(self, ops, batch, bpe, train, needs_grad, blocks, piece, vocab_rows, flops_per_weight):
        self.ops, self.batch, self.bpe, self.train, self.needs_grad = ops, batch, bpe, train, needs_grad
        self.piece, self.vocab_rows, self.fpw = piece, vocab_rows, flops_per_weight
        seq = ops[0].shape[0]
        self.seq = seq
        self.blocks = partition(seq, blocks)
        self.nodes: list[Node] = []
        self.info: dict[str, RowRecord] = {}
        self.fwd: list[dict] = []
        self.params: dict[tuple, int] = {}  # (layer, tile) -> param node
        self.tiles: dict[str, WeightTiles] = {}  # layer -> how its weights are cut
        self.stats: dict[int, dict] = {}
        self.acc: dict[tuple, int] = {}  # (layer, tile) -> the last link of its weight-gradient chain
        self.link_count: dict[str, int] = {}
        self.positions: set[str] | None = None  # tables indexed by position (row_graph's ``positions``)
        self.users: list[list[int]] = [[] for _ in ops]
        for u, o in enumerate(ops):
            for x in dict.fromkeys(o.inputs):
                self.users[x].append(u)

    # -- layout ------------------------------------------------------------------------------------

    def is_vector(self, i: int) -> bool:
        return len(self.ops[i].shape) == 1 and self.ops[i].op != "input"

    def width(self, i: int) -> int:
        o = self.ops[i]
        return 1 if o.op == "input" and len(o.shape) == 1 else o.shape[-1]

    def rows(self, i: int) -> list[tuple[int, int]]:
        return [(0, 1)] if self.is_vector(i) else self.blocks

    def cols(self, i: int) -> list[tuple[int, int]]:
        o = self.ops[i]
        if o.op == "matmul" and len(o.shape) == 3 or o.op == "softmax":
            return [(h, h + 1) for h in range(o.shape[0])]  # heads
        return pieces(self.width(i), self.piece) if not (o.op == "input" and len(o.shape) == 1) else [(0, 1)]

    def is_heads(self, i: int) -> bool:
        o = self.ops[i]
        return o.op == "softmax" or o.op == "matmul" and len(o.shape) == 3

    def nbytes(self, i: int, b: int, j: int) -> int:
        (r0, r1), (c0, c1) = self.rows(i)[b], self.cols(i)[j]
        per_row = self.seq if self.is_heads(i) else (c1 - c0)
        return (r1 - r0) * per_row * self.bpe * self.batch

    def name(self, i: int, b: int, j: int, prefix: str = "") -> str:
        mark = HEAD_MARK if self.is_heads(i) else COL_MARK
        return f"{prefix}{self.ops[i].name}{ROW_MARK}{b}{mark}{j}"

    # -- nodes -------------------------------------------------------------------------------------

    def add(self, nm: str, kind: str, nbytes: int, deps, flops: float, op: str, record: RowRecord, *,
            updates=(), writes=0, trainable=False) -> int:
        i = len(self.nodes)
        self.nodes.append(Node(i, nm, kind, int(nbytes), tuple(sorted(set(deps))), float(flops), op, 0, trainable,
                               updates=tuple(updates), writes_bytes=int(writes)))
        self.info[nm] = record
        return i

    def param(self, u: int, tile: tuple, nparams: int) -> int:
        key = (u, tile)
        if key not in self.params:
            o = self.ops[u]
            self.params[key] = self.add(f"param:{o.name}#{'.'.join(map(str, tile))}", "forward", nparams * self.bpe,
                                        (), 0.0, "param", RowRecord("param", o.name, tile=tuple(tile)),
                                        trainable=u in self.train)
        return self.params[key]

    def linear_tile(self, u: int, j: int, k: int) -> int:
        """Weight tile (output piece j, input piece k) of linear u; the bias rides in the k = 0 tile."""
        (o0, o1), (i0, i1) = self.cols(u)[j], self.cols(self.ops[u].inputs[0])[k]
        return self.param(u, (j, k), (o1 - o0) * (i1 - i0) + ((o1 - o0) if k == 0 else 0))

    def vocab(self, u: int) -> list[tuple[int, int]]:
        o = self.ops[u]
        rows = o.params // o.shape[-1]
        return partition(rows, math.ceil(rows / self.vocab_rows))

    def positional(self, u: int) -> bool:
        """A table indexed by position, not token id: a torch module's as its trace showed
        (model/torch_rows.py), the zoo's by name (it indexes its position table by position)."""
        if self.positions is not None:
            return self.ops[u].name in self.positions
        return "position" in self.ops[u].name

    # -- forward -----------------------------------------------------------------------------------

    def forward(self) -> int:
        ops = self.ops
        for i, o in enumerate(ops):
            ids: dict[tuple[int, int], int] = {}
            self.fwd.append(ids)
            if o.op == "input":
                for b in range(len(self.blocks)):
                    for j in range(len(self.cols(i))):
                        ids[b, j] = self.add(self.name(i, b, j), "forward", self.nbytes(i, b, j), (), 0.0, "input",
                                             RowRecord("forward", o.name, b=b, j=j))
            elif o.op == "embedding":
                self.tiles[o.name] = WeightTiles("embedding", tuple(self.cols(i)), vocab=tuple(self.vocab(i)))
                per = o.flops / self.seq / self.width(i)
                for j, (c0, c1) in enumerate(self.cols(i)):
                    for b, (r0, r1) in enumerate(self.blocks):
                        prev = None
                        for v, (v0, v1) in enumerate(self.vocab(i)):
                            if self.positional(i) and not (v0 < r1 and r0 < v1):
                                continue
                            last = v == len(self.vocab(i)) - 1 or self.positional(i) and v1 >= r1
                            p = self.param(i, (v, j), (v1 - v0) * (c1 - c0))
                            nm = self.name(i, b, j) if last else f"{self.name(i, b, j)}+{v}"
                            prev = self.add(nm, "forward", self.nbytes(i, b, j),
                                            (self.fwd[0][b, 0], p, *(() if prev is None else (prev,))),
                                            per * (r1 - r0) * (c1 - c0) * self.batch, "embedding",
                                            RowRecord("embed", o.name, b=b, j=j, v=v,
                                                      prev=None if prev is None else self.nodes[prev].name))
                        ids[b, j] = prev
            elif o.op == "linear":
                self.forward_linear(i)
            elif o.op == "layernorm":
                self.forward_layernorm(i)
            elif o.op == "matmul" and len(o.shape) == 3:
                q, k = o.inputs
                dh = self.width(q) // o.shape[0]
                for b, (r0, r1) in enumerate(self.blocks):
                    for h in range(o.shape[0]):
                        deps = [self.fwd[q][b, c] for c in _overlap(self.cols(q), h * dh, (h + 1) * dh)]
                        deps += [self.fwd[k][bb, c] for bb in range(len(self.blocks))
                                 for c in _overlap(self.cols(k), h * dh, (h + 1) * dh)]
                        ids[b, h] = self.add(self.name(i, b, h), "forward", self.nbytes(i, b, h), deps,
                                             2.0 * (r1 - r0) * self.seq * dh * self.batch, "matmul",
                                             RowRecord("scores", o.name, b=b, j=h))
            elif o.op == "softmax":
                (s,) = o.inputs
                for (b, h), src in self.fwd[s].items():
                    ids[b, h] = self.add(self.name(i, b, h), "forward", self.nbytes(i, b, h), (src,),
                                         o.flops * self.share(b) / o.shape[0], "softmax",
                                         RowRecord("forward", o.name, b=b, j=h))
            elif o.op == "matmul":
                p_, v_ = o.inputs
                heads = ops[p_].shape[0]
                dh = self.width(v_) // heads
                for b, (r0, r1) in enumerate(self.blocks):
                    for j, (c0, c1) in enumerate(self.cols(i)):
                        hs = range(c0 // dh, (c1 - 1) // dh + 1)
                        deps = [self.fwd[p_][b, h] for h in hs]
                        deps += [self.fwd[v_][bb, c] for bb in range(len(self.blocks))
                                 for c in _overlap(self.cols(v_), c0, c1)]
                        ids[b, j] = self.add(self.name(i, b, j), "forward", self.nbytes(i, b, j), deps,
                                             2.0 * (r1 - r0) * self.seq * (c1 - c0) * self.batch, "matmul",
                                             RowRecord("context", o.name, b=b, j=j))
            elif o.op == "avgpool":  # the mean over every token, a classifier's pooling
                self.forward_mean(i)
            elif o.op in TOKENWISE:
                for (b, j) in self.fwd[o.inputs[0]]:
                    ids[b, j] = self.add(self.name(i, b, j), "forward", self.nbytes(i, b, j),
                                         [self.fwd[x][b, j] for x in o.inputs],
                                         o.flops * self.share(b, i) * self.colshare(i, j), o.op,
                                         RowRecord("forward", o.name, b=b, j=j))
            else:
                raise PoetError(f"{o.name} ({o.op}) cannot be tiled by rows", field="--strips")
        return self.loss()

    def share(self, b: int, i: int | None = None) -> float:
        if i is not None and self.is_vector(i):
            return 1.0
        r0, r1 = self.blocks[b]
        return (r1 - r0) / self.seq

    def colshare(self, i: int, j: int) -> float:
        c0, c1 = self.cols(i)[j]
        return (c1 - c0) / self.width(i)

    def x_block(self, u: int, b: int) -> int:
        """The input row block a linear's output block b reads (the pooler: block 0, its [CLS] row)."""
        return 0 if self.is_vector(u) else b

    def forward_linear(self, u: int) -> None:
        o = self.ops[u]
        (x,) = o.inputs
        if not self.is_vector(u) and self.is_vector(x):
            raise PoetError(f"{o.name}: a token-wise linear over a vector", field="--strips")
        ids = self.fwd[u]
        kin = self.cols(x)
        rows = self.rows(u)
        for j, (c0, c1) in enumerate(self.cols(u)):
            prev: dict[int, int] = {}
            for k, (i0, i1) in enumerate(kin):
                w = self.linear_tile(u, j, k)
                for b, (r0, r1) in enumerate(rows):
                    last = k == len(kin) - 1
                    nm = self.name(u, b, j) if last else f"{self.name(u, b, j)}+{k}"
                    deps = [self.fwd[x][self.x_block(u, b), k], w, *((prev[b],) if b in prev else ())]
                    prev[b] = self.add(nm, "forward", self.nbytes(u, b, j), deps,
                                       2.0 * (r1 - r0) * (c1 - c0) * (i1 - i0) * self.batch, "linear",
                                       RowRecord("linear", o.name, b=b, j=j, k=k,
                                                 prev=self.nodes[prev[b]].name if b in prev else None))
                    if last:
                        ids[b, j] = prev[b]
        self.tiles[o.name] = WeightTiles("linear", tuple(kin), rows=tuple(self.cols(u)))

    def forward_mean(self, u: int) -> None:
        """Per feature piece, a chain over the row blocks, so that one block's rows of the input are
        needed at a time."""
        o = self.ops[u]
        (x,) = o.inputs
        if self.is_vector(x):
            raise PoetError(f"{o.name}: a mean over tokens of a vector", field="--strips")
        for j in range(len(self.cols(u))):
            prev = None
            for b in range(len(self.blocks)):
                nm = self.name(u, 0, j) if b == len(self.blocks) - 1 else f"{self.name(u, 0, j)}+{b}"
                prev = self.add(nm, "forward", self.nbytes(u, 0, j),
                                (self.fwd[x][b, j], *(() if prev is None else (prev,))),
                                o.flops * self.share(b) * self.colshare(u, j), "avgpool",
                                RowRecord("mean", o.name, b=b, j=j,
                                          prev=None if prev is None else self.nodes[prev].name))
            self.fwd[u][0, j] = prev

    def forward_layernorm(self, u: int) -> None:
        o = self.ops[u]
        (x,) = o.inputs
        cols = self.cols(u)
        self.tiles[o.name] = WeightTiles("norm", tuple(cols))
        stats = {}
        for b, (r0, r1) in enumerate(self.blocks):
            prev = None
            for k in range(len(cols)):  # 3 of layer norm's 5 FLOP per element: mean and deviations
                prev = self.add(f"lnstats:{o.name}{ROW_MARK}{b}{COL_MARK}{k}", "forward",
                                2 * (r1 - r0) * self.bpe * self.batch,
                                (self.fwd[x][b, k], *(() if prev is None else (prev,))),
                                3 * o.flops / 5 * self.share(b) * self.colshare(u, k), "layernorm_stats",
                                RowRecord("ln_stats", o.name, b=b, k=k,
                                          prev=None if prev is None else self.nodes[prev].name))
            stats[b] = prev
        self.stats[u] = stats
        for j, (c0, c1) in enumerate(cols):
            g = self.param(u, (j,), 2 * (c1 - c0))
            for b in range(len(self.blocks)):
                self.fwd[u][b, j] = self.add(self.name(u, b, j), "forward", self.nbytes(u, b, j),
                                             (self.fwd[x][b, j], stats[b], g),
                                             2 * o.flops / 5 * self.share(b) * self.colshare(u, j), "layernorm",
                                             RowRecord("forward", o.name, b=b, j=j))

    def loss(self) -> int:
        last = len(self.ops) - 1
        logits = self.fwd[last]
        if not self.is_vector(last):  # per-token logits: the loss sums row block by row block
            prev = None
            for b in range(len(self.blocks)):
                deps = [logits[b, j] for j in range(len(self.cols(last)))]
                prev = self.add("loss" if b == len(self.blocks) - 1 else f"loss{ROW_MARK}{b}", "loss",
                                self.bpe * self.batch, (*deps, *(() if prev is None else (prev,))),
                                5.0 * self.ops[last].elements * self.share(b) * self.batch, "loss",
                                RowRecord("loss", b=b, prev=None if prev is None else self.nodes[prev].name))
            return prev
        return self.add("loss", "loss", self.bpe * self.batch, list(logits.values()),
                        5.0 * self.ops[last].elements * self.batch, "loss", RowRecord("loss", b=0))

    # -- liveness ----------------------------------------------------------------------------------

    def prune(self, loss: int) -> None:
        """Forget the forward nodes the loss does not read (the last block's other tokens)."""
        live = [False] * len(self.nodes)
        live[loss] = True
        for n in reversed(self.nodes):
            if live[n.id]:
                for d in n.deps:
                    live[d] = True
        self.live = live
        for ids in self.fwd:
            for key in [key for key, nid in ids.items() if not live[nid]]:
                del ids[key]

    # -- backward ----------------------------------------------------------------------------------

    def term(self, f: int, b: int, j: int, u: int) -> list[dict]:
        """The contributions of user u to the gradient of f's piece (b, j): each a dict of deps,
        flops, whether it needs a link of its own, and the weight tile it reads (for the update's
        ordering)."""
        o, g = self.ops[u], self.grad[u]
        (r0, r1), (c0, c1) = self.rows(f)[b], self.cols(f)[j]
        n = (r1 - r0) * self.batch
        out: list[dict] = []
        if o.op == "linear":
            if self.is_vector(u) and b != 0:
                return out
            bu = 0 if self.is_vector(u) else b
            for jj, (o0, o1) in enumerate(self.cols(u)):
                if (bu, jj) in g:
                    rows = 1 if self.is_vector(u) else (r1 - r0)
                    out.append({"deps": {g[bu, jj], self.linear_tile(u, jj, j)}, "own": True, "tile": (u, jj, j, bu),
                                "flops": 2.0 * rows * self.batch * (o1 - o0) * (c1 - c0),
                                "rec": RowTerm("linear", o.name, j=jj)})
        elif o.op in TOKENWISE:
            if (b, j) in g:
                deps = {g[b, j]}
                if "in" in o.saves:  # gelu: the input piece, as the registry says its backward reads
                    deps |= {self.fwd[x][b, j] for x in o.inputs}
                if "out" in o.saves:  # tanh: the output piece
                    deps.add(self.fwd[u][b, j])
                out.append({"deps": deps, "own": False, "flops": o.flops * self.share(b, u) * self.colshare(u, j),
                            "rec": RowTerm(o.op, o.name)})
        elif o.op == "avgpool":  # every token gets 1/seq of the mean's gradient
            if (0, j) in g:
                out.append({"deps": {g[0, j]}, "own": False, "flops": float(n * (c1 - c0)),
                            "rec": RowTerm("mean", o.name)})
        elif o.op == "layernorm":
            if (b, j) in g:
                deps = {g[b, j], self.fwd[f][b, j], self.stats[u][b], self.gstats[u][b], self.params[u, (j,)]}
                out.append({"deps": deps, "own": False, "tile": (u, j, None, b), "rec": RowTerm("layernorm", o.name),
                            "flops": 3 * o.flops / 5 * self.share(b) * self.colshare(u, j)})
        elif o.op == "softmax":
            if (b, j) in g:
                out.append({"deps": {g[b, j], self.fwd[u][b, j]}, "own": False, "flops": o.flops * self.share(b)
                            / o.shape[0], "rec": RowTerm("softmax", o.name)})
        elif o.op == "matmul" and len(o.shape) == 3:  # scores = Q K^T / sqrt(dh), f is Q or K
            q, k = o.inputs
            dh = self.width(q) // o.shape[0]
            hs = range(c0 // dh, (c1 - 1) // dh + 1)
            if f == q and all((b, h) in g for h in hs):
                deps = {g[b, h] for h in hs} | {self.fwd[k][bb, j] for bb in range(len(self.blocks))}
                out.append({"deps": deps, "own": False, "flops": 2.0 * n * self.seq * (c1 - c0),
                            "rec": RowTerm("scores_q", o.name)})
            if f == k:
                for bq in range(len(self.blocks)):
                    if all((bq, h) in g for h in hs):
                        rq = self.blocks[bq]
                        out.append({"deps": {g[bq, h] for h in hs} | {self.fwd[q][bq, j]}, "own": True,
                                    "flops": 2.0 * (rq[1] - rq[0]) * self.batch * (r1 - r0) * (c1 - c0),
                                    "rec": RowTerm("scores_k", o.name, b=bq)})
        elif o.op == "matmul":  # context = P V, f is P (b, head j) or V
            p_, v_ = o.inputs
            if f == p_:
                dh = self.width(v_) // self.ops[p_].shape[0]
                jj = _overlap(self.cols(u), j * dh, (j + 1) * dh)
                if all((b, c) in g for c in jj):
                    deps = {g[b, c] for c in jj} | {self.fwd[v_][bb, c] for bb in range(len(self.blocks))
                                                   for c in _overlap(self.cols(v_), j * dh, (j + 1) * dh)}
                    out.append({"deps": deps, "own": False, "flops": 2.0 * n * self.seq * dh,
                                "rec": RowTerm("context_p", o.name)})
            if f == v_:
                dh = self.width(v_) // self.ops[p_].shape[0]
                hs = range(c0 // dh, (c1 - 1) // dh + 1)
                for bq in range(len(self.blocks)):
                    if (bq, j) in g:
                        rq = self.blocks[bq]
                        out.append({"deps": {g[bq, j]} | {self.fwd[p_][bq, h] for h in hs}, "own": True,
                                    "flops": 2.0 * (rq[1] - rq[0]) * self.batch * (r1 - r0) * (c1 - c0),
                                    "rec": RowTerm("context_v", o.name, b=bq)})
        return out

    def backward(self, loss: int) -> None:
        ops = self.ops
        logits = len(ops) - 1
        self.grad: list[dict] = [{} for _ in ops]
        self.host: dict[tuple, int] = {}
        self.gstats: dict[int, dict] = {}
        for f in reversed(range(len(ops))):
            if not self.needs_grad[f]:
                continue
            for u in self.users[f]:
                if ops[u].op == "layernorm" and self.grad[u]:
                    self.layernorm_gstats(u, f)
            links: dict[tuple[int, int], list[list[dict]]] = {}
            for key in sorted(self.fwd[f]):
                terms = [t for u in self.users[f] for t in self.term(f, *key, u)]
                own = [t for t in terms if t["own"]]
                plain = [t for t in terms if not t["own"]]
                if terms or f == logits:
                    links[key] = [[t] for t in own[:-1]] + [own[-1:] + plain]
            prev: dict[tuple[int, int], int] = {}
            # piece by piece, so that one piece's partial sums are alive at a time; within a piece,
            # link n of every row block in turn, so that a weight tile serves its data and weight
            # gradients of every block while it is in RAM
            for j in sorted({j for _, j in links}):
                keys = [key for key in sorted(links) if key[1] == j]
                most = max(len(links[key]) for key in keys)
                for n in range(most):
                    for key in keys:
                        groups = links[key]
                        skip = most - len(groups)  # the final links of all blocks come last
                        if n >= skip:
                            self.grad_link(f, key, groups[n - skip], n - skip == len(groups) - 1, prev, loss)
            for key in links:
                self.grad[f][key] = prev[key]
            # weight gradients went along with the data gradients that read the same tiles; a layer
            # whose input needs no gradient has none, and sums its own now
            if f in self.train and not any(self.needs_grad[x] for x in ops[f].inputs):
                self.weight_update(f)

    def grad_link(self, f: int, key, group: list[dict], final: bool, prev: dict, loss: int) -> None:
        b, j = key
        deps: set[int] = {prev[key]} if key in prev else set()
        flops = 0.0
        logits = len(self.ops) - 1
        if final and f == logits:  # softmax minus target, over each token's whole row of logits
            deps |= {loss, *(self.fwd[f][b, c] for c in range(len(self.cols(f))))}
            flops += 2.0 * self.nbytes(f, b, j) / self.bpe
        for t in group:
            deps |= t["deps"]
            flops += t["flops"]
        base = self.name(f, b, j, "grad:")
        nm = base if final else f"{base}+{self.link_count.get(base, 0)}"
        self.link_count[base] = self.link_count.get(base, 0) + 1
        prev[key] = self.add(nm, "backward", self.nbytes(f, b, j), deps, flops, f"{self.ops[f].op}_grad",
                             RowRecord("grad", of=self.ops[f].name, b=b, j=j, terms=tuple(t["rec"] for t in group),
                                       prev=self.nodes[prev[key]].name if key in prev else None,
                                       logits=final and f == logits))
        for t in group:
            if "tile" in t:
                self.host[t["tile"]] = prev[key]
                u, jj, k, bu = t["tile"]
                if u in self.train:  # the tile's weight gradient over this block, while the tile is in RAM
                    self.wgrad_link(u, (jj,) if k is None else (jj, k), bu)

    def layernorm_gstats(self, u: int, x: int) -> None:
        o = self.ops[u]
        self.gstats[u] = {}
        for b, (r0, r1) in enumerate(self.blocks):
            prev = None
            for k in range(len(self.cols(u))):
                if (b, k) not in self.grad[u]:
                    continue
                prev = self.add(f"lngstats:{o.name}{ROW_MARK}{b}{COL_MARK}{k}", "backward",
                                2 * (r1 - r0) * self.bpe * self.batch,
                                (self.grad[u][b, k], self.fwd[x][b, k], self.stats[u][b], self.params[u, (k,)],
                                 *(() if prev is None else (prev,))),
                                o.flops / 5 * self.share(b) * self.colshare(u, k), "layernorm_grad_stats",
                                RowRecord("ln_gstats", o.name, b=b, k=k,
                                          prev=None if prev is None else self.nodes[prev].name))
            if prev is not None:
                self.gstats[u][b] = prev

    def weight_update(self, u: int) -> None:
        o = self.ops[u]
        g = self.grad[u]
        if o.op == "embedding":
            vocab = self.vocab(u)
            for v, (v0, v1) in enumerate(vocab):
                for j in range(len(self.cols(u))):
                    blocks = [b for b, (r0, r1) in enumerate(self.blocks) if (b, j) in g
                              and (not self.positional(u) or v0 < r1 and r0 < v1)]
                    if (u, (v, j)) not in self.params:
                        continue  # a position tile past the sequence: never read, never changed
                    p = self.params[u, (v, j)]
                    n = self.nodes[p].bytes // self.bpe
                    self.add(f"update:{o.name}#{v}.{j}", "backward", 0,
                             {p, *(g[b, j] for b in blocks), *(self.fwd[0][b, 0] for b in blocks)},
                             sum(self.nbytes(u, b, j) / self.bpe for b in blocks) + self.fpw * n, "sgd_update",
                             RowRecord("embed_update", o.name, v=v, j=j, blocks=tuple(blocks)),
                             updates=(p,), writes=n * self.bpe)
            return
        if o.op == "layernorm":
            tiles = [(j,) for j in range(len(self.cols(u)))]
        else:
            tiles = [(j, k) for j in range(len(self.cols(u))) for k in range(len(self.cols(o.inputs[0])))]
        for tile in tiles:  # the input needs no gradient: no data-gradient link has read the tiles
            for b in range(len(self.rows(u))):
                if (b, tile[0]) in self.grad[u]:
                    self.wgrad_link(u, tile, b)

    def wgrad_link(self, u: int, tile: tuple, b: int) -> None:
        """The next link of tile's weight-gradient chain over row blocks: block b's part added to the
        sum so far; the last block's link applies the update."""
        o = self.ops[u]
        g = self.grad[u]
        (x,) = o.inputs
        j = tile[0]
        k = tile[1] if len(tile) == 2 else None
        blocks = [bb for bb in range(len(self.rows(u))) if (bb, j) in g]
        acc = self.acc.get((u, tile))
        p = self.params[u, tile]
        n = self.nodes[p].bytes // self.bpe
        last = b == blocks[-1]
        r0, r1 = self.rows(u)[b]
        deps = {g[b, j], self.fwd[x][self.x_block(u, b), j if k is None else k]}
        if o.op == "layernorm":
            deps.add(self.stats[u][b])
        reader = self.host.get((u, j, k, b))
        if reader is not None:  # the link that read the old tile for this block comes first
            deps.add(reader)
        if acc is not None:
            deps.add(acc)
        fields: dict = {}
        if last:
            deps.add(p)
            fields = {"updates": (p,), "writes": n * self.bpe}
        label = f"{o.name}#{'.'.join(map(str, tile))}"
        self.acc[u, tile] = self.add(
            f"update:{label}" if last else f"wgrad:{label}{ROW_MARK}{b}", "backward", 0 if last else n * self.bpe, deps,
            2.0 * (r1 - r0) * self.batch * n + (self.fpw * n if last else 0), "sgd_update" if last else f"{o.op}_wgrad",
            RowRecord("wgrad", o.name, tile=tuple(tile), b=b, update=last,
                      prev=None if acc is None else self.nodes[acc].name), **fields)


def row_graph(name: str, ops: Sequence, batch: int, bpe: int, train: set[int], needs_grad: list[bool], meta: dict,
              tiling: dict, *, flops_per_weight: float = 2.0, divisors: dict | None = None,
              positions=None) -> TrainingGraph:
    """The streamed-weights training graph (plain SGD) of transformer ``ops`` (untiled, the zoo's
    per-sample shapes) with ``tiling`` = {"blocks": row blocks, "piece": features per column piece,
    "vocab_rows": table rows per embedding tile}. ``divisors``: scores layer -> what its products
    are divided by, where not sqrt(d_head) (the zoo folds that in; a torch module writes its own).
    ``positions``: the embeddings indexed by position (None: those named so, as the zoo's)."""
    if not is_transformer(ops):
        other = next((o for o in ops if o.op not in ROW_OPS), None)  # name the operator rows cannot split
        why = f"; {other.name} ({other.op}) cannot be tiled by rows" if other is not None else ""
        raise PoetError(f"row tiling is for transformers (the zoo's, or a torch module's linear layers, layer "
                        f"norms and softmax attention){why}",
                        field="--strips")
    blocks, piece = int(tiling["blocks"]), int(tiling["piece"])
    vocab_rows = int(tiling.get("vocab_rows") or piece)
    if min(blocks, piece, vocab_rows) < 1:
        raise PoetError(f"row tiling needs positive counts, got {tiling!r}", field="--strips")
    built = _Builder(ops, batch, bpe, train, needs_grad, blocks, piece, vocab_rows, flops_per_weight)
    built.positions = None if positions is None else set(positions)
    loss = built.forward()
    built.prune(loss)
    built.backward(loss)
    keep = [n for n in built.nodes if n.kind != "forward" or built.live[n.id]]
    kept = {n.id for n in keep}
    assert all(d in kept for n in keep for d in n.deps), "a node reads a forward node the loss does not need"
    layers = {o.name: TiledLayer(o.name, o.op, tuple(o.shape), tuple(ops[x].name for x in o.inputs), o.params,
                                 cls=built.is_vector(i) and o.op == "linear" and not built.is_vector(o.inputs[0]),
                                 positional=o.op == "embedding" and built.positional(i),
                                 divisor=(divisors or {}).get(o.name))
              for i, o in enumerate(ops)}
    meta = {**meta, "rows": RowTiling(layers, {n.name: built.info[n.name] for n in keep}, blocks=built.blocks,
                                      piece=piece, vocab_rows=vocab_rows,
                                      cols={o.name: built.cols(i) for i, o in enumerate(ops)}, tiles=built.tiles)}
    return TrainingGraph.build(name, keep, meta=meta)


ROW_OPS_OWN = ("layernorm_stats", "layernorm_grad_stats", "linear_wgrad", "layernorm_wgrad")


def row_node(nodes) -> str | None:
    """The first node of a graph or schedule document that belongs to row tiling, or None."""
    return first_node_of(nodes, ROW_OPS_OWN, rf"{ROW_MARK}\d+({COL_MARK}|{HEAD_MARK})?\d*")


def refuse_rows(nodes, who: str, field: str) -> None:
    """Executors without row kernels refuse a row-tiled plan rather than run it wrongly."""
    name = row_node(nodes)
    if name is not None:
        raise PoetError(f"the plan tiles a transformer by token rows (node {name}); {who} does not run row "
                        "tiling yet", field=field)
