"""What each node of a row-tiled transformer graph (poet_opt.model.rows) computes, in PyTorch.

``replay`` runs the graph's nodes once each, in the graph's order, every node reading only the
tensors its ``deps`` name (a node that needs more raises KeyError: the graph would be wrong).
Tensors are (N, rows, features) pieces, vectors (the pooler's) (N, 1, features). The semantics
are the zoo's, as examples/torch_models.py writes them in PyTorch: post-LN blocks, layer norm with
eps 1e-5, exact (erf) GELU, scores scaled by 1/sqrt(d_head), the word table indexed by token id and
the position table by position, the pooler on the [CLS] token, tanh, and cross-entropy on the
logits. It keeps every tensor (no RAM budget): it checks the graph's maths, not a schedule
(tests/test_rows.py compares it with autograd on the untiled model).

Parameters are given per layer in PyTorch's shapes: linear ``weight`` (out, in) and ``bias``,
layer norm ``weight`` and ``bias``, embedding ``weight`` (rows, d).
"""

from __future__ import annotations

from poet_opt.model import ops as registry
from poet_opt.model.rows import TOKENWISE

EPS = 1e-5  # torch.nn.LayerNorm's default


def replay(graph, params: dict, ids, y, lr: float) -> dict:
    """Run ``graph`` on token ids ``ids`` (N, seq) and labels ``y`` (N,); ``params``: layer ->
    {role: tensor}, updated in place by the graph's SGD updates. Returns {"loss", "values",
    "weight_grads" (layer -> {role: gradient}, assembled from the tiles' updates)}."""
    return _Replay(graph, params, ids, y, lr).run()


def run_plan(graph, steps, params: dict, ids, y, lr: float) -> dict:
    """Execute a row plan: ``steps`` are (op, node name) pairs of a schedule of ``graph``, run as
    executor/strips.py's ``run_plan`` runs a strip plan (each compute on resident tensors only,
    page-outs and page-ins through a stand-in for storage, updates once, in place). Returns the
    loss, the weight gradients and the peak of the resident bytes as the graph sizes them."""
    from poet_opt.executor.strips import execute

    return execute(_Replay(graph, params, ids, y, lr), graph, steps)


def replayer(graph, params: dict, x, y, lr: float):
    """The replay's node computer (``.compute(node, .records[name], env)``), for an executor that
    walks a plan: ``params`` may be empty, when every weight comes from a ``param:`` node's value."""
    return _Replay(graph, params, x, y, lr)


class _Replay:
    def __init__(self, graph, params, ids, y, lr):
        import torch

        self.t, self.graph, self.params, self.ids, self.y, self.lr = torch, graph, params, ids, y, lr
        self.tiling = tiling = graph.meta["rows"]
        self.blocks = [tuple(b) for b in tiling.blocks]
        self.layers, self.records, self.tiles = tiling.layers, tiling.nodes, tiling.tiles
        self.cols = {name: [tuple(c) for c in cs] for name, cs in tiling.cols.items()}
        self.vocab_rows = tiling.vocab_rows
        self.values: dict = {}
        self.weight_grads: dict = {}
        self.seq = self.blocks[-1][1]

    def run(self) -> dict:
        for node in self.graph.nodes:
            env = {self.graph.nodes[d].name: self.values[self.graph.nodes[d].name] for d in node.deps}
            self.values[node.name] = self.compute(node, self.records[node.name], env)
        return {"loss": self.values["loss"], "values": self.values, "weight_grads": self.weight_grads}

    # -- layout ------------------------------------------------------------------------------------




    def gather(self, env, layer: str, b: int, lo: int, hi: int, prefix: str = ""):
        """Columns [lo, hi) of row block b of ``layer`` (or of its gradient), from its pieces."""
        return self.t.cat([env[self.tiling.tile_name(layer, b, j, prefix)][:, :, r0 - a:r1 - a]
                           for j, (a, _), (r0, r1) in self.tiling.pieces(layer, lo, hi)], dim=2)

    def all_rows(self, env, layer: str, lo: int, hi: int):
        return self.t.cat([self.gather(env, layer, b, lo, hi) for b in range(len(self.blocks))], dim=1)


    def param(self, env, layer: str, tile) -> dict:
        """The weights of one tile, as the tile's own tensors: what its ``param:`` node holds in RAM."""
        return env[f"param:{layer}#{'.'.join(map(str, tile))}"]

    def tile_where(self, layer: str, tile) -> dict:
        """role -> the index of a tile's part of the layer's whole parameter."""
        return {role: tuple(slice(lo, hi) for lo, hi in ranges)
                for role, ranges in self.tiling.tile_ranges(layer, tile).items()}

    def tile_values(self, layer: str, tile) -> dict:
        """A tile's weights cut from the whole parameters: views, so that updating a tile in place
        updates the whole (the executor stores a copy of each on its storage instead)."""
        return {role: self.params[layer][role][where] for role, where in self.tile_where(layer, tile).items()}


    # -- nodes -------------------------------------------------------------------------------------

    def compute(self, node, rec, env):
        role = rec.role
        if role == "param":
            return self.tile_values(rec.layer, tuple(rec.tile))
        if role == "loss":
            return self.loss(rec, env)
        if role in ("forward", "scores", "context"):
            return self.forward(rec, env)
        if role == "embed":
            return self.embed(rec, env)
        if role == "mean":  # the mean over tokens, summed block by block
            x = self.layers[rec.layer].inputs[0]
            part = env[self.tiling.tile_name(x, rec.b, rec.j)].sum(dim=1, keepdim=True) / self.seq
            return part if rec.prev is None else env[rec.prev] + part
        if role == "linear":
            lay = self.layers[rec.layer]
            x = self.layers[rec.layer].inputs[0]
            xb = env[self.tiling.tile_name(x, 0 if lay.cls else rec.b, rec.k)]
            if lay.cls:
                xb = xb[:, :1]
            w = self.param(env, rec.layer, (rec.j, rec.k))
            out = xb @ w["weight"].T
            if rec.k == 0:
                out = out + w["bias"]
            return out if rec.prev is None else env[rec.prev] + out
        if role == "ln_stats":
            x = self.layers[rec.layer].inputs[0]
            xs = env[self.tiling.tile_name(x, rec.b, rec.k)]
            count, mean = xs.shape[2], xs.mean(dim=2)
            m2 = ((xs - mean[:, :, None]) ** 2).sum(dim=2)
            if rec.prev is None:
                return (count, mean, m2)
            n_a, mean_a, m2_a = env[rec.prev]  # Chan et al.: merge two parts' means and squared deviations
            n = n_a + count
            delta = mean - mean_a
            return (n, mean_a + delta * count / n, m2_a + m2 + delta ** 2 * n_a * count / n)
        if role == "ln_gstats":
            layer, b, k = rec.layer, rec.b, rec.k
            x = self.layers[layer].inputs[0]
            gamma = self.param(env, layer, (k,))["weight"]
            gg = env[self.tiling.tile_name(layer, b, k, "grad:")] * gamma
            xhat = self.xhat(env, layer, b, env[self.tiling.tile_name(x, b, k)])
            sums = (gg.sum(dim=2), (gg * xhat).sum(dim=2))
            if rec.prev is None:
                return sums
            prev = env[rec.prev]
            return (prev[0] + sums[0], prev[1] + sums[1])
        if role == "grad":
            return self.gradient(rec, env)
        if role == "wgrad":
            return self.weight_gradient(rec, env)
        if role == "embed_update":
            return self.embed_update(rec, env)
        raise ValueError(f"unknown role {role!r} of node {node.name}")

    def stats(self, env, layer: str, b: int):
        n, mean, m2 = env[self.tiling.chain_end("lnstats:", layer, b)]
        return mean, m2 / n

    def xhat(self, env, layer: str, b: int, xs):
        mean, var = self.stats(env, layer, b)
        return (xs - mean[:, :, None]) / self.t.sqrt(var + EPS)[:, :, None]

    def token_rows(self, b: int, positional: bool, env):
        r0, r1 = self.blocks[b]
        env[self.tiling.tile_name("input", b, 0)]  # the token ids of the block are a dependency, positions too
        if positional:
            return self.t.arange(r0, r1).expand(self.ids.shape[0], -1)
        return self.ids[:, r0:r1]

    def embed(self, rec, env):
        layer, b, j, v = rec.layer, rec.b, rec.j, rec.v
        lay = self.layers[layer]
        (c0, c1) = self.cols[layer][j]
        v0, v1 = self.tiles[layer].vocab[v]
        table = self.param(env, layer, (v, j))["weight"]
        idx = self.token_rows(b, lay.positional, env)
        inside = (idx >= v0) & (idx < v1)
        out = table[(idx - v0).clamp(0, v1 - v0 - 1)] * inside[:, :, None]
        return out if rec.prev is None else env[rec.prev] + out


    def forward(self, rec, env):
        layer = rec.layer
        lay = self.layers[layer]
        op, inputs, b, j = lay.op, lay.inputs, rec.b, rec.j
        if op == "input":
            r0, r1 = self.blocks[b]
            if self.ids.dim() == 3:  # hidden states, not token ids: their feature piece j
                (c0, c1) = self.cols[layer][j]
                return self.ids[:, r0:r1, c0:c1]
            return self.ids[:, r0:r1]
        if op == "layernorm":
            w = self.param(env, layer, (j,))
            return self.xhat(env, layer, b, env[self.tiling.tile_name(inputs[0], b, j)]) * w["weight"] + w["bias"]
        if op == "softmax":
            return self.t.softmax(env[self.tiling.tile_name(inputs[0], b, j)], dim=-1)
        if op == "matmul" and len(lay.shape) == 3:  # scores of head j for row block b
            dh = self.tiling.head_dim(layer)
            q = self.gather(env, inputs[0], b, j * dh, (j + 1) * dh)
            k = self.all_rows(env, inputs[1], j * dh, (j + 1) * dh)
            return q @ k.transpose(1, 2) / self.tiling.divisor(layer)
        if op == "matmul":  # context: piece j of row block b
            p, v = inputs
            dh = self.tiling.head_dim(self._scores_of(p))
            (c0, c1) = self.cols[layer][j]
            out = []
            for h in range(c0 // dh, (c1 - 1) // dh + 1):
                lo, hi = max(c0, h * dh), min(c1, (h + 1) * dh)
                out.append(env[self.tiling.tile_name(p, b, h)] @ self.all_rows(env, v, lo, hi))
            return self.t.cat(out, dim=2)
        xs = [env[self.tiling.tile_name(i, b, j)] for i in inputs]
        spec = registry.get(op)
        if op in TOKENWISE and spec.torch_forward is not None:  # add, gelu, tanh, ...: piece by piece
            return spec.torch_forward(self.t, *xs)
        raise ValueError(f"no row kernel for {op}")

    def _scores_of(self, probs: str) -> str:
        return self.layers[probs].inputs[0]

    def logits_rows(self, env, b: int):
        last = list(self.layers)[-1]
        return last, self.gather(env, last, b, 0, self.layers[last].shape[-1])

    def loss(self, rec, env):
        last, logits = self.logits_rows(env, rec.b)
        if self.tiling.vector(last):
            return self.t.nn.functional.cross_entropy(logits[:, 0], self.y)
        r0, r1 = self.blocks[rec.b]  # per-token labels: the mean over every token, block by block
        part = self.t.nn.functional.cross_entropy(logits.flatten(0, 1), self.y[:, r0:r1].flatten(), reduction="sum")
        part = part / (self.y.numel())
        return part if rec.prev is None else env[rec.prev] + part

    # -- gradients ---------------------------------------------------------------------------------

    def gradient(self, rec, env):
        f, b, j = rec.of, rec.b, rec.j
        total = env[rec.prev] if rec.prev else 0
        (c0, c1) = (0, 0) if self.tiling.heads(f) else self.cols[f][j]
        if rec.logits:
            last, logits = self.logits_rows(env, b)
            classes = logits.shape[2]
            if self.tiling.vector(last):
                onehot = self.t.nn.functional.one_hot(self.y, classes).to(logits.dtype)[:, None]
                scale = logits.shape[0]
            else:
                r0, r1 = self.blocks[b]
                onehot = self.t.nn.functional.one_hot(self.y[:, r0:r1], classes).to(logits.dtype)
                scale = self.y.numel()
            total = total + ((self.t.softmax(logits, dim=-1) - onehot) / scale)[:, :, c0:c1]
        for term in rec.terms:
            total = total + self.term(term, f, b, j, env)
        return total

    def term(self, term, f: str, b: int, j: int, env):
        t = self.t
        kind, u = term.kind, term.layer
        if kind == "linear":
            lay = self.layers[u]
            jj = term.j
            g = env[self.tiling.tile_name(u, 0 if lay.cls or self.tiling.vector(u) else b, jj, "grad:")]
            part = g @ self.param(env, u, (jj, j))["weight"]
            if lay.cls:  # the pooler read the [CLS] token: the block's other rows get nothing
                r0, r1 = self.blocks[b]
                full = t.zeros(part.shape[0], r1 - r0, part.shape[2], dtype=part.dtype)
                full[:, :1] = part
                return full
            return part
        if kind == "add":
            return env[self.tiling.tile_name(u, b, j, "grad:")]
        if kind == "mean":
            r0, r1 = self.blocks[b]
            return (env[self.tiling.tile_name(u, 0, j, "grad:")] / self.seq).expand(-1, r1 - r0, -1)
        spec = registry.get(kind)
        if kind in TOKENWISE and spec.arity == 1:  # gelu, tanh, ...: from what its backward reads
            return spec.torch_gradient(t, env[self.tiling.tile_name(u, b, j, "grad:")],
                                       x=env[self.tiling.tile_name(f, b, j)] if spec.saves == "in" else None,
                                       y=env[self.tiling.tile_name(u, b, j)] if spec.saves == "out" else None)
        if kind == "layernorm":
            d = self.layers[u].shape[-1]
            gamma = self.param(env, u, (j,))["weight"]
            _, var = self.stats(env, u, b)
            xhat = self.xhat(env, u, b, env[self.tiling.tile_name(f, b, j)])
            s1, s2 = env[self.tiling.chain_end("lngstats:", u, b)]
            g = env[self.tiling.tile_name(u, b, j, "grad:")] * gamma
            return (g - s1[:, :, None] / d - xhat * s2[:, :, None] / d) / t.sqrt(var + EPS)[:, :, None]
        if kind == "softmax":
            p, dp = env[self.tiling.tile_name(u, b, j)], env[self.tiling.tile_name(u, b, j, "grad:")]
            return p * (dp - (dp * p).sum(dim=-1, keepdim=True))
        if kind in ("scores_q", "scores_k"):
            dh = self.tiling.head_dim(u)
            q_name, k_name = self.layers[u].inputs
            (c0, c1) = self.cols[f][j]
            out = []
            for h in range(c0 // dh, (c1 - 1) // dh + 1):
                lo, hi = max(c0, h * dh), min(c1, (h + 1) * dh)
                if kind == "scores_q":
                    ds = env[self.tiling.tile_name(u, b, h, "grad:")]
                    out.append(ds @ self.all_rows(env, k_name, lo, hi) / self.tiling.divisor(u))
                else:
                    bq = term.b
                    r0, r1 = self.blocks[b]
                    ds = env[self.tiling.tile_name(u, bq, h, "grad:")][:, :, r0:r1]
                    out.append(ds.transpose(1, 2) @ self.gather(env, q_name, bq, lo, hi) / self.tiling.divisor(u))
            return t.cat(out, dim=2)
        if kind == "context_p":
            p_name, v_name = self.layers[u].inputs
            dh = self.tiling.head_dim(self._scores_of(p_name))
            dc = self.gather(env, u, b, j * dh, (j + 1) * dh, "grad:")
            return dc @ self.all_rows(env, v_name, j * dh, (j + 1) * dh).transpose(1, 2)
        if kind == "context_v":
            p_name, _ = self.layers[u].inputs
            dh = self.tiling.head_dim(self._scores_of(p_name))
            (c0, c1) = self.cols[f][j]
            bq = term.b
            r0, r1 = self.blocks[b]
            out = []
            for h in range(c0 // dh, (c1 - 1) // dh + 1):
                lo, hi = max(c0, h * dh), min(c1, (h + 1) * dh)
                p = env[self.tiling.tile_name(p_name, bq, h)][:, :, r0:r1]
                dc = self.gather(env, u, bq, lo, hi, "grad:")
                out.append(p.transpose(1, 2) @ dc)
            return t.cat(out, dim=2)
        raise ValueError(f"no row gradient for {kind}")

    # -- weight gradients --------------------------------------------------------------------------

    def weight_gradient(self, rec, env):
        layer, tile, b = rec.layer, rec.tile, rec.b
        lay = self.layers[layer]
        x = lay.inputs[0]
        if lay.op == "layernorm":
            (j,) = tile
            g = env[self.tiling.tile_name(layer, b, j, "grad:")]
            xhat = self.xhat(env, layer, b, env[self.tiling.tile_name(x, b, j)])
            part = {"weight": (g * xhat).sum(dim=(0, 1)), "bias": g.sum(dim=(0, 1))}
        else:
            j, k = tile
            g = env[self.tiling.tile_name(layer, 0 if self.tiling.vector(layer) else b, j, "grad:")]
            xs = env[self.tiling.tile_name(x, 0 if lay.cls else b, k)]
            if lay.cls:
                xs = xs[:, :1]
            part = {"weight": g.flatten(0, 1).T @ xs.flatten(0, 1)}
            if k == 0:
                part["bias"] = g.sum(dim=(0, 1))
        if rec.prev:
            part = {role: env[rec.prev][role] + v for role, v in part.items()}
        if not rec.update:
            return part
        self.apply(env, layer, tuple(tile), part)
        return None

    def embed_update(self, rec, env):
        layer, v, j = rec.layer, rec.v, rec.j
        (v0, v1), (c0, c1) = self.tiles[layer].vocab[v], self.cols[layer][j]
        grad = self.t.zeros(v1 - v0, c1 - c0, dtype=self.param(env, layer, (v, j))["weight"].dtype)
        for b in rec.blocks:  # the sparse gradient: the rows of the tokens seen
            idx = self.token_rows(b, self.layers[layer].positional, env)
            g = env[self.tiling.tile_name(layer, b, j, "grad:")]
            inside = (idx >= v0) & (idx < v1)
            grad.index_add_(0, (idx[inside] - v0), g[inside])
        self.apply(env, layer, (v, j), {"weight": grad})
        return None

    def apply(self, env, layer: str, tile: tuple, grads: dict) -> None:
        """SGD on the tile's tensors in RAM, in place; the gradient is kept, placed in the whole
        layer's, where the whole parameters are known (a replay, not a plan's run)."""
        weights = self.param(env, layer, tile)
        where = self.tile_where(layer, tile)
        with self.t.no_grad():
            for role, g in grads.items():
                if layer in self.params:
                    store = self.weight_grads.setdefault(layer, {})
                    store.setdefault(role, self.t.zeros_like(self.params[layer][role]))[where[role]] = g
                weights[role] -= self.lr * g
