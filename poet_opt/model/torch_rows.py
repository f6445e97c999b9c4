"""Row tiles of a transformer given as a torch module (``--torch``): its traced operators put in the
zoo's per-sample vocabulary, which model/rows.py tiles into blocks of tokens (docs/streaming.md).

The trace (model/torch_import.py) sees attention as PyTorch writes it: a product of head-split
views of Q and K, a division by a constant, a softmax, a product with a head-split view of V, and
a transposing reshape back to (seq, d). The zoo's row graph has the same maths as three operators
(scores, softmax, context) whose head split is implicit. This module maps one onto the other, and
checks the mapping on a random input rather than trusting the shapes: each view the row graph
leaves implicit must give exactly the tensor the module computed, or the lowering is refused
naming the node. A mean over the tokens (a classifier's pooling) becomes ``avgpool`` over a (seq,
d) tensor, as the zoo's global pooling of a (C, H, W) one.
"""

from __future__ import annotations

import numbers
from dataclasses import replace

from poet_opt.errors import PoetError
from poet_opt.model import ops as registry
from poet_opt.model.ops import support
from poet_opt.model.rows import ROW_OPS, TOKENWISE, is_transformer

FIELD = "--strips"


def is_row_model(ops) -> bool:
    """A traced module that row tiles are for: attention by matrix products, no convolution."""
    return tokens_in_rows(ops.ops)


def tokens_in_rows(nodes) -> bool:
    """Operators (traced ops or a graph's nodes) that row tiles are for: attention by matrix
    products, no convolution. Every command asks this of a --torch module the same way."""
    return any(o.op == "matmul" for o in nodes) and not any(o.op == "conv2d" for o in nodes)


def row_ops(module, ops, output: int):
    """(the zoo-shaped operators, under their traced names; scores layer -> what its products are
    divided by) of a traced transformer, or a PoetError naming the node row tiles cannot take."""
    import torch

    src = ops.ops
    vocabulary = token_vocabulary(module, ops)
    values = _values(torch, module, ops, vocabulary)
    needed = {output}
    for i in range(output, -1, -1):
        if i in needed:
            needed.update(src[i].inputs)
    batch = src[0].shape[0]
    if len(src[0].shape) != (2 if vocabulary else 3):
        raise PoetError(f"row tiles take (batch, tokens, features) inputs, or (batch, tokens) token ids into an "
                        f"embedding, not {tuple(src[0].shape)}", field=FIELD)
    users = {i: [u for u in needed if i in src[u].inputs] for i in needed}
    out: list = []
    index: dict[int, int] = {}  # traced op -> row op standing for it
    divisors: dict[str, float] = {}
    positions: set[str] = set()  # embeddings indexed by position, not token id

    placeholder = next(n for n in values if n.op == "placeholder")

    def fx(i):
        return ops.origins.get(src[i].name, placeholder)

    def add(i, op, shape, inputs, *, flops=None):
        o = src[i]
        new = replace(o, op=op, shape=tuple(shape), inputs=tuple(index[x] for x in inputs),
                      flops=(o.flops if flops is None else flops) / batch)
        index[i] = len(out)
        out.append(new)

    for i in sorted(needed):
        o = src[i]
        n = fx(i)
        if o.op == "input":
            add(i, "input", o.shape[1:], ())
        elif o.op == "embedding" and o.inputs == (0,):  # of the token ids, or of their positions
            if _position_table(torch, module, n, o, values[placeholder], values[n]):
                positions.add(o.name)
            add(i, "embedding", o.shape[1:], o.inputs)
        elif o.op == "linear" and len(o.shape) == 2 and len(src[o.inputs[0]].shape) == 3:  # a pooler on [CLS]
            m, xv = _check_module(module, n, o), values[fx(o.inputs[0])]
            _same(values[n], torch.nn.functional.linear(xv[:, 0], m.weight, m.bias), o.name,
                  "a linear layer of a (tokens, features) tensor's first token only, or of every token", exact=False)
            add(i, "linear", o.shape[1:], o.inputs)
        elif o.op == "matmul" and len(o.shape) == 4 and len(src[o.inputs[0]].shape) == 3:  # scores, heads split
            if len(o.inputs) != 2 or len(users[i]) != 1:  # the divisor is the scores node's, for its one reader
                raise PoetError(f"node {o.name!r}: attention scores of one tensor with itself, or read twice",
                                field=FIELD)
            q, k = o.inputs
            heads, seq = o.shape[1], o.shape[2]
            dh = src[q].shape[-1] // heads
            _same(values[n.args[0]], _heads(values[fx(q)], heads), o.name, "its left operand is not Q split into heads")
            split = _heads(values[fx(k)], heads)
            _same(values[n.args[1]], None if split is None else split.transpose(-2, -1), o.name,
                  "its right operand is not K split into heads and transposed")
            add(i, "matmul", (heads, seq, seq), (q, k), flops=2.0 * batch * seq * seq * heads * dh)
            divisors[o.name] = 1.0
        elif o.op in ("div", "mul") and len(o.inputs) == 1 and src[o.inputs[0]].name in divisors \
                and len(users[i]) == 1:
            constant = n.args[1] if len(n.args) == 2 else None
            if isinstance(constant, torch.fx.Node):  # computed from the input's shape, a number on any input
                constant = values[constant]
            if n.args[0] is not fx(o.inputs[0]) or not isinstance(constant, numbers.Real) or constant == 0:
                raise PoetError(f"node {o.name!r}: attention scores scaled other than by one constant", field=FIELD)
            scores = src[o.inputs[0]].name
            divisors[scores] *= float(constant) if o.op == "div" else 1.0 / float(constant)
            _same(values[n], values[fx(o.inputs[0])] / divisors[scores], o.name, "not a division of the scores",
                  exact=False)
            index[i] = index[o.inputs[0]]  # the scaling is the scores node's
        elif o.op == "softmax" and len(o.shape) == 4:
            if n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None) not in (-1, 3):
                raise PoetError(f"node {o.name!r}: a softmax over other than the keys", field=FIELD)
            add(i, "softmax", o.shape[1:], o.inputs)
        elif o.op == "matmul" and len(o.shape) == 4 and len(o.inputs) == 2 and src[o.inputs[0]].op == "softmax":
            p, v = o.inputs  # the context, heads split: the reshape after it joins them
            heads = o.shape[1]
            _same(values[n.args[0]], values[fx(p)], o.name, "its left operand is not the attention probabilities")
            _same(values[n.args[1]], _heads(values[fx(v)], heads), o.name,
                  "its right operand is not V split into heads")
            seq, d = o.shape[2], heads * o.shape[3]
            add(i, "matmul", (seq, d), (p, v), flops=2.0 * batch * seq * seq * d)
        elif o.op == "copy" and src[o.inputs[0]].op == "matmul" and len(src[o.inputs[0]].shape) == 4:
            _same(values[n], values[fx(o.inputs[0])].transpose(1, 2).reshape(o.shape), o.name,
                  "not the heads joined back into (tokens, features)")
            index[i] = index[o.inputs[0]]
        elif o.op == "avgpool" and len(o.shape) == 2 and len(src[o.inputs[0]].shape) == 3:
            _same(values[n], values[fx(o.inputs[0])].mean(dim=1), o.name, "not a mean over the tokens", exact=False)
            add(i, "avgpool", o.shape[1:], o.inputs)
        elif (o.op in ("linear", "layernorm") or o.op in TOKENWISE and _replayed(o.op)) and len(o.shape) in (2, 3):
            if o.op in ("linear", "layernorm"):  # on its input as it is: a view between them would move rows
                m, F = _check_module(module, n, o), torch.nn.functional
                xv = values[fx(o.inputs[0])]
                want = F.linear(xv, m.weight, m.bias) if o.op == "linear" else \
                    F.layer_norm(xv, m.normalized_shape, m.weight, m.bias, m.eps)
                _same(values[n], want, o.name, f"{o.op} of other than its input's rows", exact=False)
            else:  # the replay runs the registry's reference on the inputs' pieces: a constant operand, a
                # slope or a repeated input would be lost
                _same(values[n], _reference(o.op, [values[fx(x)] for x in o.inputs]), o.name,
                      f"{o.op} of other than its tensor operands", exact=False)
            add(i, o.op, o.shape[1:], o.inputs)
        else:
            why = " (the row replay has no rule for it)" if o.op in ROW_OPS else " (the row builder has no rule for it)"
            raise PoetError(f"node {o.name!r} ({o.op}, shape {tuple(o.shape)}) cannot be tiled by rows{why}",
                            field=FIELD)
    if index[output] != len(out) - 1:
        raise PoetError(f"node {src[output].name!r}: the output must be the last operator", field=FIELD)
    if not is_transformer(out):
        raise PoetError("row tiles are for attention blocks; this module has no attention", field=FIELD)
    return out, divisors, positions


def token_vocabulary(module, ops) -> int | None:
    """The rows of the smallest nn.Embedding indexed by the traced input itself (the token ids,
    through views that keep each id as it is), or None: the input is no token ids."""
    import torch

    modules = dict(module.named_modules())
    rows = [m.num_embeddings for o in ops.ops[1:] if o.op == "embedding" and o.inputs == (0,)
            for n in [ops.origins.get(o.name)] if n is not None and n.op == "call_module" and _ids_as_they_are(n)
            for m in [modules.get(n.target)] if isinstance(m, torch.nn.Embedding)]
    return min(rows) if rows else None


def input_vocabulary(module, input_shape) -> int | None:
    """:func:`token_vocabulary` of a module not lowered yet (one trace): what `run` and `emulate`
    check a batch's x against before anything is solved (model/batch.py's check_x)."""
    from poet_opt.model.torch_import import lower_module

    ops, _ = lower_module(module, tuple(input_shape))
    return token_vocabulary(module, ops)


def _ids_as_they_are(n) -> bool:
    """The index of fx call ``n`` is the input, through reshapes and integer casts only."""
    a = n.args[0] if n.args else None
    while a is not None and a.op == "call_method" and a.target in ("view", "reshape", "flatten", "long", "int", "to",
                                                                     "contiguous"):
        a = a.args[0]
    return a is not None and a.op == "placeholder"


def _position_table(torch, module, n, o, ids, got) -> bool:
    """Whether a traced embedding gathers the rows of the token ids (False) or of their positions
    0..seq-1 (True), as its value on random ids shows; any other index is refused naming the node."""
    m = dict(module.named_modules()).get(n.target) if n.op == "call_module" else None
    if not isinstance(m, torch.nn.Embedding) or m.max_norm is not None or m.sparse or m.padding_idx is not None:
        raise PoetError(f"node {o.name!r}: row tiles take an embedding as an nn.Embedding module without max_norm, "
                        "padding_idx or sparse gradients", field=FIELD)
    F = torch.nn.functional
    if int(ids.max()) < m.num_embeddings and torch.equal(got, F.embedding(ids, m.weight)):
        return False
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    if ids.shape[1] <= m.num_embeddings and torch.equal(got, F.embedding(positions, m.weight)):
        return True
    raise PoetError(f"node {o.name!r}: an embedding of other than the token ids or their positions; row tiles "
                    "cannot take it", field=FIELD)


def _replayed(op: str) -> bool:
    """An elementwise operator the row replay runs from its registry entry (the support table's)."""
    return support.runs(registry.spec(op), "rows", "executor")


def _heads(t, heads: int):
    """(batch, tokens, features) split into heads of consecutive features; None if it is not that."""
    if t.dim() != 3 or t.shape[2] % heads:
        return None
    b, s, d = t.shape
    return t.view(b, s, heads, d // heads).transpose(1, 2)


def _same(got, want, node: str, what: str, *, exact: bool = True) -> None:
    import torch

    ok = want is not None and got.shape == want.shape and \
        (torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-5, atol=1e-6))
    if not ok:
        raise PoetError(f"node {node!r}: {what}; row tiles cannot take it", field=FIELD)


def _reference(op: str, inputs: list):
    import torch

    try:
        return registry.spec(op).torch_forward(torch, *inputs)
    except (TypeError, RuntimeError):
        return None


def _check_module(module, n, o) -> None:
    import torch

    m = dict(module.named_modules()).get(n.target) if n.op == "call_module" else None
    if isinstance(m, torch.nn.Linear) and m.bias is not None:
        return m
    if isinstance(m, torch.nn.LayerNorm) and m.elementwise_affine and m.bias is not None and m.eps == 1e-5 \
            and len(m.normalized_shape) == 1:
        return m
    raise PoetError(f"node {o.name!r}: row tiles take {o.op} as an nn.{'Linear' if o.op == 'linear' else 'LayerNorm'}"
                    " module with a bias (and eps 1e-5 for a norm)", field=FIELD)


def _values(torch, module, ops, vocabulary=None):
    """Every traced node's value on a random input (token ids below ``vocabulary`` when it is
    given), to check the views the row graph leaves out."""
    graph = next(iter(ops.origins.values())).graph
    values: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    gen = torch.Generator().manual_seed(0)
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            x = torch.randn(ops.ops[0].shape, generator=gen) if vocabulary is None else \
                torch.randint(0, vocabulary, ops.ops[0].shape, generator=gen)
            Recorder(module, graph=graph).run(x)
    finally:
        module.train(was)
    return values


def row_training_graph(name: str, module, ops, output: int, trainable, meta: dict, strips, budget):
    """The row-tiled streamed training graph of a traced transformer: ``strips`` "auto" (the tiling
    with the fewest nodes that brings every node within ``budget``; None when none does) or N row
    blocks. Returns (graph or None, the zoo-shaped operators)."""
    from poet_opt.model.zoo import training_graph

    kept, divisors, positions = row_ops(module, ops, output)
    if budget is None:
        raise PoetError("row tiling of a transformer needs --ram or a device to fit", field=FIELD)
    meta = {**meta, "bytes_per_element": 4, "forward_layers": len(kept) - 1}
    rows = {"budget": budget, "divisors": divisors, "positions": positions,
            **({} if strips == "auto" else {"blocks": int(strips)})}
    return training_graph(name, kept, ops.ops[0].shape[0], 4, trainable, meta, weights="streamed", rows=rows), kept
