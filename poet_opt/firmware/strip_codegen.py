"""The C of a schedule of an activation-strip graph (poet_opt/model/strips.py, docs/streaming.md).

Each node of a strip graph computes rows [a, b) of one tensor, and ``graph.meta["strips"].nodes``
records what: the generator reads that record, as poet_opt/executor/strips.py does in PyTorch, and
emits the same maths on the strip buffers the plan holds in the arena:

- a convolution or pooling strip, its data gradient into an input strip, and a strip's share of a
  convolution's weight gradient run the whole-tensor kernels on a window of rows. The rows a
  window reads lie in several strips (its halo), so they are first copied into one scratch buffer
  (``poet_scratch``, static RAM beside the arena, reported as ``scratch_bytes``) with the padding
  rows written out (zeros, or -inf for max pooling), and the kernel runs with no padding along H;
  a data gradient gathers the output-gradient rows the same way and adds the rows of the local
  input gradient that fall in its strip;
- batch norm over strips chains its per-channel statistics (``stats:L@sj``: mean and sum of
  squared deviations, merged with Chan et al.'s update) and the sums its backward needs
  (``gstats:L@sj``), and normalises each strip with the last (poet_kernels_strips.c);
- activations and add go strip by strip with the registry's elementwise kernels (OpSpec.c_forward), and
  so does the concat of weight slices; a weight slice over strips reads its channels of the concat's
  gradient strips (``grad_alias``), so no per-slice gradient is stored;
- ``wgrad:L@sj`` adds strip j's weight gradient to the previous link's; the last link adds its part
  into the previous sum (which nothing reads after it) and applies ``w -= lr * g`` to the weights in
  the arena, then writes them back, as a streamed layer's update does.

Nodes whose tensors are whole (one strip, global pooling, the linear head) run as in writer.py.
"""

from __future__ import annotations

import re

from poet_opt.errors import PoetError
from poet_opt.firmware.c_text import identifier
from poet_opt.firmware.writer import LR, StepWriter, c_float, c_ident, elementwise_backward, elementwise_kernel
from poet_opt.model import ops as registry
from poet_opt.model.tiling_records import touching, window_rows

WINDOWED = registry.names(split="window", tiling="strips")  # the registry's convolutions and pooling
NEG_INF = "(-__builtin_inff())"
# Scratch a window's kernel call may use: a window is cut into chunks of output rows that fit it,
# so the scratch stays small beside the arena whatever the strips (one output row at the least)
SCRATCH_BYTES = 8 * 1024


class StripWriter(StepWriter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tiling = tiling = self.net.graph.meta["strips"]
        self.layers_meta, self.records = tiling.layers, tiling.nodes
        # a weight slice over strips reads its channels of the concat's gradient strips (model/strips.py)
        self.alias = dict(tiling.grad_alias)
        self.scratch_floats = 0
        self.windows: dict[tuple, str] = {}

    # -- geometry --------------------------------------------------------------------------------



    def buf(self, ops, layer: str, j: int, prefix: str = "") -> str:
        if prefix == "grad:" and layer in self.alias:
            concat, lo, _ = self.aliased(layer)
            n, _, _, w = self.nchw(layer)
            if n != 1:
                raise PoetError(f"internal: {layer}'s gradient strip is not contiguous at batch {n}; gather it")
            a, b = self.tiling.strips(layer)[j]
            return f"({self.buf(ops, concat, j, prefix)} + {lo * (b - a) * w}u)"
        return self.at(ops, self.tiling.strip_name(layer, j, prefix), f"a strip of {layer}")

    def aliased(self, layer: str) -> tuple[str, int, int]:
        """(the concat whose gradient a weight slice reads, the slice's first channel, the concat's
        channels)."""
        concat = self.net.layers[self.alias[layer]]
        lo, _ = concat.attrs["bounds"][concat.operands.index(layer)]
        return concat.name, lo, concat.shape[1]

    def concat_slices(self, concat, rows: int, w: int) -> list[tuple[int, int, int]]:
        """Per tile of a concat over one strip of ``rows`` rows: (first float of its channels in a
        sample's block, its floats per sample, the whole strip's floats per sample)."""
        whole = concat.shape[1] * rows * w
        return [(lo * rows * w, (hi - lo) * rows * w, whole) for lo, hi in concat.attrs["bounds"]]

    def nchw(self, layer: str) -> tuple[int, int, int, int]:
        n, c, h, w = self.net.layers[layer].shape
        return n, c, h, w


    def scratch(self, floats: int) -> None:
        self.scratch_floats = max(self.scratch_floats, floats)

    def gather(self, dst: str, row0: int, rows: int, layer: str, lo: int, hi: int, ops, prefix: str = "",
               fill: str | None = "0.0f") -> list[str]:
        """Rows [lo, hi) of ``layer`` (or its gradient) into ``dst``, which holds rows [row0, row0 +
        rows) of every plane; rows past the tensor are ``fill``."""
        n, c, h, w = self.nchw(layer)
        lines = []
        for j, (a, b), (r0, r1) in self.tiling.pieces(layer, lo, hi):
            if prefix == "grad:" and layer in self.alias:
                # a weight slice's channels of the concat's gradient strip: c planes in each sample's block
                concat, first, channels = self.aliased(layer)
                src = self.buf(ops, concat, j, prefix)
                lines += [f"poet_copy_strided({dst} + {(s * c * rows + r0 - row0) * w}u, {src} + "
                          f"{((s * channels + first) * (b - a) + r0 - a) * w}u, {c}u, {(r1 - r0) * w}u, {rows * w}u, "
                          f"{(b - a) * w}u);" for s in range(n)]
            else:
                lines.append(f"poet_copy_strided({dst} + {(r0 - row0) * w}u, {self.buf(ops, layer, j, prefix)} + "
                             f"{(r0 - a) * w}u, {n * c}u, {(r1 - r0) * w}u, {rows * w}u, {(b - a) * w}u);")
        if lo < 0:
            lines.append(f"poet_fill_strided({dst}, {fill}, {n * c}u, {-lo * w}u, {rows * w}u);")
        if hi > h:
            lines.append(f"poet_fill_strided({dst} + {(h - row0) * w}u, {fill}, {n * c}u, {(hi - h) * w}u, "
                         f"{rows * w}u);")
        return lines

    def window_shape(self, layer, rows_in: int, rows_out: int) -> str:
        """The kernel geometry of ``layer`` on a window of input rows, padded along W only: a const
        table at file scope (in flash), one per distinct window, since a compound literal in the
        step function would take its place on the stack."""
        a = layer.attrs
        n, c, _, w = layer.operand_shapes[0]
        (kh, kw), (sh, sw), (_, pw) = (tuple(a[k]) for k in ("kernel", "stride", "padding"))
        wo = layer.shape[3]
        if layer.op == "conv2d":
            fields = [n, c, rows_in, w, layer.shape[1], rows_out, wo, kh, kw, sh, sw, 0, pw, a["groups"]]
            kind = "poet_conv2d_shape"
        else:
            fields = [n, c, rows_in, w, rows_out, wo, kh, kw, sh, sw, 0, pw]
            kind = "poet_pool2d_shape"
        key = (kind, *fields)
        if key not in self.windows:
            self.windows[key] = identifier("poet_window", len(self.windows))
            values = ", ".join(f"{v}u" for v in fields)
            self.decls.append(f"static const {kind} {self.windows[key]} = {{{values}}};\n")
        return "&" + self.windows[key]

    # -- nodes -----------------------------------------------------------------------------------

    def compute(self, node: int, info: dict, out: str, ops: dict[int, int], first: bool) -> list[str]:
        rec = self.records[info["name"]]
        role = rec.role
        if role in ("param", "loss"):
            return super().compute(node, info, out, ops, first)
        if role == "forward":
            return self.strip_forward(rec, out, ops, first)
        if role == "bn_stats":
            return self.stats(rec, out, ops)
        if role == "bn_gstats":
            return self.grad_stats(rec, out, ops)
        if role == "grad":
            return self.gradient(node, rec, out, ops)
        if role == "wgrad":
            return self.wgrad(node, rec, out, ops)
        if role == "update":  # batch norm on the input, one strip: as unstriped
            return super().compute(node, info, out, ops, first)
        raise PoetError(f"internal: node {info['name']!r} has no strip kernel ({role})")

    def whole(self, layer: str) -> bool:
        """Whether the layer and its inputs are single tensors, run as unstriped graphs run them."""
        names = [layer, *self.layers_meta[layer].inputs]
        return not any(self.tiling.striped(x) for x in names) and self.net.layers[layer].op not in WINDOWED

    def strip_forward(self, rec, out, ops, first) -> list[str]:
        name, rows = rec.layer, rec.rows
        layer = self.net.layers[name]
        if self.whole(name):
            return self.forward(layer, out, ops, first)
        op = layer.op
        if rows is None:  # a whole tensor (global pooling) of a striped input
            if op != "global_avgpool":
                raise PoetError(f"node {name!r}: no strip kernel reads a striped {op} input whole", field="--strips")
            x = layer.operands[0]
            n, c, h, w = self.nchw(x)
            lines = [f"poet_zero({out}, {n * c}u);"]
            for j, (a, b) in enumerate(self.tiling.strips(x)):
                lines.append(f"poet_global_avgpool_strip_forward({out}, {self.buf(ops, x, j)}, {n * c}u, "
                             f"{(b - a) * w}u, {h * w}u);")
            return lines
        a, b = rows
        j = self.tiling.strip_index(name, rows)
        n, c, h, w = self.nchw(name)
        count = n * c * (b - a) * w
        if op == "input":
            return [f"poet_copy_strided({out}, poet_input + {a * w}u, {n * c}u, {(b - a) * w}u, {(b - a) * w}u, "
                    f"{h * w}u);"]
        if op in WINDOWED:
            return self.window_forward(layer, a, b, out, ops)
        xs = [self.buf(ops, x, j) for x in layer.operands]
        if op == "batchnorm" and self.evaluating and layer.buffers:
            return [self.batchnorm_eval(layer, out, xs[0], ops, n, (b - a) * w)]
        if op == "batchnorm":
            k = self.layer_index[name]
            stats = self.at(ops, self.tiling.chain_end("stats:", name), f"{name}'s strips")
            lines = [f"poet_batchnorm_strip_forward({out}, {xs[0]}, {stats}, {self.param(layer, 'weight', ops)}, "
                     f"{self.param(layer, 'bias', ops)}, {n}u, {c}u, {(b - a) * w}u, {n * h * w}u, "
                     f"{c_float(layer.attrs['eps'])});"]
            if first and j == 0 and layer.buffers:  # the running statistics move once a step
                lines.append(f"poet_batchnorm_strip_running({c_ident(k, 'running_mean')}, {c_ident(k, 'running_var')}, "
                             f"{stats}, {c}u, {n * h * w}u, {c_float(layer.attrs['momentum'])});")
            return lines
        if elementwise_kernel(op):  # activations, add: strip by strip with the registry's kernel
            return [f"{registry.spec(op).c_forward}({out}, {', '.join(xs)}, {count}u);"]
        if op == "concat":  # the weight slices' channels, side by side in each sample's block
            return [f"poet_copy_strided({out} + {first}u, {x}, {n}u, {part}u, {whole}u, {part}u);"
                    for x, (first, part, whole) in zip(xs, self.concat_slices(layer, b - a, w))]
        raise PoetError(f"node {name!r}: no strip kernel for operator {op}", field="--strips")

    def eval_unneeded(self) -> set[int]:
        # the chained batch statistics: eval mode normalises each strip with the running statistics
        return {self.by_name[name] for name, rec in self.records.items()
                if rec.role == "bn_stats" and self.net.layers[rec.layer].buffers and name in self.by_name}

    def chunk_rows(self, total: int, floats) -> int:
        """Output rows per kernel call: the most whose scratch, ``floats(rows)``, stays within
        SCRATCH_BYTES (one row at the least)."""
        rows = 1
        while rows < total and 4 * floats(rows + 1) <= SCRATCH_BYTES:
            rows += 1
        return rows

    def window_forward(self, layer, a: int, b: int, out: str, ops) -> list[str]:
        """Output rows [a, b) of a convolution or pooling, a chunk of rows at a time: the input rows
        a chunk reads are gathered into scratch, the kernel writes the chunk beside them (or
        straight into ``out`` when one chunk is the whole strip) and the chunk is copied into place."""
        x = layer.operands[0]
        window = self.layers_meta[layer.name].window
        k, s, _ = window
        n, c, _, w = self.nchw(layer.name)
        _, cx, _, wx = self.nchw(x)

        def floats(rows: int) -> int:
            return n * cx * ((rows - 1) * s + k) * wx + (n * c * rows * w if rows < b - a else 0)

        per = self.chunk_rows(b - a, floats)
        lines = []
        for c0 in range(a, b, per):
            c1 = min(b, c0 + per)
            r0, r1 = window_rows((c0, c1), window)
            rows_in = r1 - r0
            local = n * cx * rows_in * wx
            y = out if c1 - c0 == b - a else f"(poet_scratch + {local}u)"
            self.scratch(local + (0 if y == out else n * c * (c1 - c0) * w))
            lines += self.gather("poet_scratch", r0, rows_in, x, r0, r0 + rows_in, ops,
                                 fill=NEG_INF if layer.op == "maxpool" else "0.0f")
            shape = self.window_shape(layer, rows_in, c1 - c0)
            if layer.op == "conv2d":
                lines.append(f"poet_conv2d_forward({y}, poet_scratch, {self.param(layer, 'weight', ops)}, "
                             f"{self.param(layer, 'bias', ops)}, {shape});")
            else:
                lines.append(f"poet_{layer.op}2d_forward({y}, poet_scratch, {shape});")
            if y != out:
                lines.append(f"poet_copy_strided({out} + {(c0 - a) * w}u, {y}, {n * c}u, {(c1 - c0) * w}u, "
                             f"{(b - a) * w}u, {(c1 - c0) * w}u);")
        return lines

    def stats(self, rec, out, ops) -> list[str]:
        name, (a, b) = rec.layer, rec.rows
        j = self.tiling.strip_index(name, (a, b))
        x = self.layers_meta[name].inputs[0]
        n, c, _, w = self.nchw(name)
        prev = self.chain_link(ops, "stats:", name, j)
        return [f"poet_batchnorm_strip_stats({out}, {prev}, {self.buf(ops, x, j)}, {n}u, {c}u, {(b - a) * w}u, "
                f"{n * a * w}u);"]

    def chain_link(self, ops, prefix: str, layer: str, j: int) -> str:
        """The previous link of strip j's statistics chain, NULL for the first."""
        if not j:
            return "NULL"
        return self.at(ops, self.tiling.strip_name(layer, j - 1, prefix), self.tiling.strip_name(layer, j, prefix))

    def grad_stats(self, rec, out, ops) -> list[str]:
        name, (a, b) = rec.layer, rec.rows
        j = self.tiling.strip_index(name, (a, b))
        x = self.layers_meta[name].inputs[0]
        n, c, h, w = self.nchw(name)
        prev = self.chain_link(ops, "gstats:", name, j)
        stats = self.at(ops, self.tiling.chain_end("stats:", name), self.tiling.strip_name(name, j, "gstats:"))
        return [f"poet_batchnorm_strip_grad_stats({out}, {prev}, {self.buf(ops, name, j, 'grad:')}, "
                f"{self.buf(ops, x, j)}, {stats}, {n}u, {c}u, {(b - a) * w}u, {n * h * w}u, "
                f"{c_float(self.net.layers[name].attrs['eps'])});"]

    # -- gradients -------------------------------------------------------------------------------

    def gradient(self, node: int, rec, out, ops) -> list[str]:
        f, rows = rec.of, rec.rows
        layer = self.net.layers[f]
        count = layer.elements if rows is None else layer.elements // layer.shape[2] * (rows[1] - rows[0])
        lines = [f"poet_copy({out}, {self.at(ops, rec.prev, rec.prev)}, {count}u);" if rec.prev
                 else f"poet_zero({out}, {count}u);"]
        if rec.logits:
            labels = self.net.layers[self.net.output]
            lines.append(f"poet_cross_entropy_backward({out}, {self.at(ops, f, 'the loss gradient')}, poet_labels, "
                         f"{labels.shape[0]}u, {labels.elements // labels.shape[0]}u);")
        for u in rec.terms:
            lines += self.term(u, f, rows, out, ops)
        for p in self.nodes[node].get("updates", ()):  # after the data gradients, which read the old weights
            lines += self.update(p, ops)
        return lines

    def term(self, u: str, f: str, rows, out: str, ops) -> list[str]:
        """out += the data gradient back through u into rows ``rows`` of f."""
        user = self.net.layers[u]
        op = user.op
        if rows is None or (not self.tiling.striped(u) and not self.tiling.striped(f) and op not in WINDOWED):
            return [self.data_gradient(user, which, out, ops, f) for which, o in enumerate(user.operands) if o == f]
        lo, hi = rows
        n, c, h, w = self.nchw(f)
        count = n * c * (hi - lo) * w
        if len(self.layers_meta[u].shape) != 3:  # global pooling of the whole tensor
            if op != "global_avgpool":
                raise PoetError(f"node {u!r}: no strip kernel back-propagates a whole {op}", field="--strips")
            return [f"poet_global_avgpool_strip_backward({out}, {self.at(ops, 'grad:' + u, u)}, {n * c}u, "
                    f"{(hi - lo) * w}u, {h * w}u);"]
        if op in WINDOWED:
            return self.window_gradient(user, f, rows, out, ops)
        j = self.tiling.strip_index(f, rows)
        g = self.buf(ops, u, j, "grad:")
        if op == "batchnorm":
            stats = self.at(ops, self.tiling.chain_end("stats:", u), f"{u}'s backward")
            sums = self.at(ops, self.tiling.chain_end("gstats:", u), f"{u}'s backward")
            return [f"poet_batchnorm_strip_backward({out}, {g}, {self.buf(ops, f, j)}, {stats}, {sums}, "
                    f"{self.param(user, 'weight', ops)}, {n}u, {c}u, {(hi - lo) * w}u, {n * h * w}u, "
                    f"{c_float(user.attrs['eps'])});"]
        if elementwise_kernel(op):  # one call per operand that is f (x + x adds twice)
            return [elementwise_backward(op, out, g, count, lambda x: self.buf(ops, x, j), u, user.operands)
                    for o in user.operands if o == f]
        if op == "concat":  # a slice's gradient is its channels of the concat's
            first, part, whole = self.concat_slices(user, hi - lo, w)[user.operands.index(f)]
            return [f"poet_accumulate_strided({out}, {g} + {first}u, {n}u, {part}u, {part}u, {whole}u);"]
        raise PoetError(f"node {u!r}: no strip kernel back-propagates a {op}", field="--strips")

    def window_gradient(self, user, f: str, rows, out: str, ops) -> list[str]:
        """The gradient rows of f that u's output-gradient rows touch, a chunk of those at a time:
        gather the chunk's output-gradient rows into scratch, run the whole backward kernel on its
        window there, and add the window's rows that are f's (the windows of chunks overlap, and
        their contributions add)."""
        u = user.name
        lo, hi = rows
        window = self.layers_meta[u].window
        k, s, _ = window
        m0, m1 = touching((lo, hi), window, self.nchw(u)[2])
        n, c, _, w = self.nchw(f)
        _, cu, _, wu = self.nchw(u)
        copies = 2 if user.op == "maxpool" else 1  # max pooling also reads its input's window

        def floats(chunk: int) -> int:
            return copies * n * c * ((chunk - 1) * s + k) * w + n * cu * chunk * wu

        lines = []
        per = self.chunk_rows(m1 - m0, floats) if m0 < m1 else 1
        for c0 in range(m0, m1, per):
            c1 = min(m1, c0 + per)
            r0, r1 = window_rows((c0, c1), window)
            rows_in = r1 - r0
            local = n * c * rows_in * w
            dx, gy = "poet_scratch", f"(poet_scratch + {local}u)"
            x = f"(poet_scratch + {local + n * cu * (c1 - c0) * wu}u)"
            self.scratch(floats(c1 - c0))
            lines += self.gather(gy, c0, c1 - c0, u, c0, c1, ops, "grad:", None)
            shape = self.window_shape(user, rows_in, c1 - c0)
            if user.op == "conv2d":  # writes the window's dx (dx =): no zeroing
                lines.append(f"poet_conv2d_backward_input_set({dx}, {gy}, {self.param(user, 'weight', ops)}, "
                             f"{shape});")
            elif user.op == "maxpool":  # where the maximum of every touched window is
                lines.append(f"poet_zero({dx}, {local}u);")
                lines += self.gather(x, r0, rows_in, f, r0, r0 + rows_in, ops, fill=NEG_INF)
                lines.append(f"poet_maxpool2d_backward({dx}, {gy}, {x}, {shape});")
            else:
                lines.append(f"poet_zero({dx}, {local}u);")
                lines.append(f"poet_avgpool2d_backward({dx}, {gy}, {shape});")
            a, b = max(lo, r0), min(hi, r0 + rows_in)
            if a < b:
                lines.append(f"poet_accumulate_strided({out} + {(a - lo) * w}u, {dx} + {(a - r0) * w}u, {n * c}u, "
                             f"{(b - a) * w}u, {(hi - lo) * w}u, {rows_in * w}u);")
        return lines

    # -- weights ---------------------------------------------------------------------------------

    def wgrad(self, node: int, rec, out, ops) -> list[str]:
        """One link of a convolution's weight-gradient chain over its output strips; the last
        applies the SGD step to the weights in the arena and writes them back."""
        name, rows = rec.layer, rec.rows
        layer = self.net.layers[name]
        updates = self.nodes[node].get("updates", ())
        if layer.op != "conv2d" or rows is None:
            return [line for p in updates for line in self.update(p, ops)]
        a, b = rows
        x = layer.operands[0]
        window = self.layers_meta[name].window
        k, s, _ = window
        n, cx, _, wx = self.nchw(x)
        _, c, _, w = self.nchw(name)
        # a slice's gradient rows at batch > 1 lie in several blocks of the concat's: gathered
        gather_gy = name in self.alias and n > 1
        gy_whole = None if gather_gy else self.buf(ops, name, self.tiling.strip_index(name, rows), "grad:")
        weights = layer.params["weight"].value.size
        total = sum(q.value.size for q in layer.params.values())
        prev = self.at(ops, rec.prev, rec.prev) if rec.prev else None
        last = bool(updates)
        own = last and prev is None  # a single link: its sum needs a buffer of its own, in scratch

        def floats(chunk: int) -> int:
            split = chunk < b - a or gather_gy
            return n * cx * ((chunk - 1) * s + k) * wx + (n * c * chunk * w if split else 0) + (total if own else 0)

        per = self.chunk_rows(b - a, floats)
        fused = own and per == b - a  # one kernel call: fold the gradient straight into the weights
        into = out if not last else prev if prev is not None else f"(poet_scratch + {floats(per) - total}u)"
        lines = []
        if not last:
            lines.append(f"poet_copy({out}, {prev}, {total}u);" if prev else f"poet_zero({out}, {total}u);")
        elif own and not fused:
            lines.append(f"poet_zero({into}, {total}u);")
        w_arena = self.param(layer, "weight", ops) if last else None
        for c0 in range(a, b, per):
            c1 = min(b, c0 + per)
            r0, r1 = window_rows((c0, c1), window)
            rows_in = r1 - r0
            local = n * cx * rows_in * wx
            self.scratch(floats(c1 - c0) if own else
                         local + (n * c * (c1 - c0) * w if per < b - a or gather_gy else 0))
            lines += self.gather("poet_scratch", r0, rows_in, x, r0, r0 + rows_in, ops)
            gy = gy_whole
            if per < b - a or gather_gy:
                gy = f"(poet_scratch + {local}u)"
                lines += self.gather(gy, c0, c1 - c0, name, c0, c1, ops, "grad:", None)
            shape = self.window_shape(layer, rows_in, c1 - c0)
            if fused:
                lines.append(f"poet_conv2d_backward_params_sgd({w_arena}, {self.param(layer, 'bias', ops)}, {gy}, "
                             f"poet_scratch, {shape}, {LR});")
            else:
                bias = f"{into} + {weights}u" if "bias" in layer.params else "NULL"
                lines.append(f"poet_conv2d_backward_params({into}, {bias}, {gy}, poet_scratch, {shape});")
        if not last:
            return lines
        if not fused:  # the previous sum is read by nothing after this link: it takes the last part in place
            lines.append(f"poet_sgd_step({w_arena}, {into}, {total}u, {LR});")
        return lines + self.write_back(updates[0], ops)

    def write_back(self, p: int, ops) -> list[str]:
        return [f"rc = poet_page_out({self.flash.offsets[p]}u, (poet_arena + {ops[p] // 4}u), "
                f"{int(self.nodes[p]['bytes'])}u);", "if (rc) return rc;"]

    def update(self, p: int, ops) -> list[str]:
        layer = self.param_layers[p]
        if layer.op != "batchnorm" or not self.tiling.striped(layer.name):
            return super().update(p, ops)
        # gamma and beta's gradients are the whole tensor's sums of dy * xhat and dy
        c = layer.shape[1]
        sums = self.at(ops, self.tiling.chain_end("gstats:", layer.name), f"{layer.name}'s update")
        lr = LR
        return [f"poet_sgd_step({self.param(layer, 'weight', ops)}, {sums} + {c}u, {c}u, {lr});",
                f"poet_sgd_step({self.param(layer, 'bias', ops)}, {sums}, {c}u, {lr});", *self.write_back(p, ops)]

    def finish(self, lines: list[str]) -> None:
        # a striped layer's kernels take their geometry inline, and batch norm over strips keeps its
        # statistics in the arena: the whole-tensor declarations they leave unused would not compile
        used = set(re.findall(r"poet_\w+", "\n".join(lines)))
        self.decls = [d for d in self.decls if "__attribute__((used))" in d
                      or used & set(re.findall(r"(poet_\w+_\d+)(?:\[| =)", d))]
        # halo windows and their gradients, gathered from several strips (its size is in scratch_bytes)
        self.decls.append(f"static float poet_scratch[{max(1, self.scratch_floats)}];\n")


def scratch_bytes(source: str) -> int:
    """The scratch buffer a generated step declares, in bytes (0 for a step without strips)."""
    marker = "static float poet_scratch["
    at = source.find(marker)
    return 0 if at < 0 else 4 * int(source[at + len(marker):source.index("]", at)])

