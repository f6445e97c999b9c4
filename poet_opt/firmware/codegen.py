"""C sources that perform training steps exactly as a validated schedule says.

One function, ``poet_train_step``, walks the schedule's steps in order: each compute (first time or
recompute), page-out and page-in at the arena offsets of the export's plan, then one SGD update.
The training graph's semantics (poet_opt.model.zoo) decide what a node computes:

- a forward node runs its layer's kernel;
- ``grad:f`` is the gradient of the loss with respect to f's output: zeroed, then one contribution
  per user u of f (the data gradient back through u, which reads grad:u and what u saved), plus the
  softmax cross-entropy gradient when f is the logits; and when f has trainable weights, their
  gradients, which read f's inputs.

A recompute produces the same bytes as the first compute, but side effects must happen once per
step: running statistics move and weight gradients accumulate only at a node's first compute,
which the generator knows statically. Trainable weights, their gradients and the per-channel
statistics of the norms are static RAM; frozen weights, the batch and its labels are const (flash).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.firmware.arena import ArenaPlan, FlashPlan
from poet_opt.model.network import Layer, Network

KERNEL_FILES = ("poet_kernels_basic.c", "poet_kernels_conv.c", "poet_kernels_norm.c", "poet_math.c")
# the page-out and page-in over a board's three storage functions (firmware/board/)
PAGING_FILES = ("poet_paging.c",)


@dataclass
class GeneratedStep:
    source: str  # poet_train.c
    param_symbols: dict[str, str]  # torch name -> C symbol of each trainable parameter
    steps: int


def _float(v: float) -> str:
    v = float(np.float32(v))
    if not math.isfinite(v):
        raise PoetError(f"a weight or input value is {v}; the firmware starts from finite numbers", field="--data")
    return f"{v.hex()}f" if v else "0.0f"


def _array(ctype: str, name: str, values: np.ndarray, *, const: bool, used: bool = False) -> str:
    flat = values.reshape(-1)
    fmt = _float if ctype == "float" else (lambda v: str(int(v)))
    body = ",\n".join("    " + ", ".join(fmt(v) for v in flat[k:k + 6]) for k in range(0, len(flat), 6))
    attrs = "__attribute__((used)) " if used else ""
    storage = "static const " if const else ("" if used else "static ")
    return f"{attrs}{storage}{ctype} {name}[{max(1, len(flat))}] = {{\n{body or '    0'}\n}};\n"


def _ident(k: int, role: str) -> str:
    return f"poet_{role}_{k}"


class _Writer:
    def __init__(self, network: Network, doc: dict, plan: ArenaPlan, flash: FlashPlan, lr: float):
        self.net, self.doc, self.plan, self.flash, self.lr = network, doc, plan, flash, float(lr)
        self.nodes = doc["graph"]["nodes"]
        self.by_name = {n["name"]: i for i, n in enumerate(self.nodes)}
        self.layer_index = {name: k for k, name in enumerate(network.layers)}
        self.users: dict[str, list[Layer]] = {name: [] for name in network.layers}
        for layer in network.layers.values():
            for operand in dict.fromkeys(layer.operands):
                self.users[operand].append(layer)
        self.decls: list[str] = []
        self.param_symbols: dict[str, str] = {}

    # -- operands --------------------------------------------------------------------------------

    def at(self, offsets: dict[int, int], name: str, why: str) -> str:
        node = self.by_name.get(name)
        if node is None or node not in offsets:
            raise PoetError(f"internal: the schedule does not hold {name!r} where {why} needs it")
        return f"(poet_arena + {offsets[node] // 4}u)"

    def param(self, layer: Layer, role: str) -> str:
        return _ident(self.layer_index[layer.name], role) if role in layer.params else "NULL"

    def grad(self, layer: Layer, role: str) -> str:
        return _ident(self.layer_index[layer.name], "g" + role) if role in layer.params else "NULL"

    # -- declarations ----------------------------------------------------------------------------

    def declare(self) -> None:
        for layer in self.net.layers.values():
            k = self.layer_index[layer.name]
            for role, p in layer.params.items():
                name = _ident(k, role)
                self.decls.append(f"/* {p.torch_name} {list(p.value.shape)} */\n"
                                  + _array("float", name, p.value, const=not layer.trainable, used=layer.trainable))
                if layer.trainable:
                    self.param_symbols[p.torch_name] = name
                    self.decls.append(f"static float {_ident(k, 'g' + role)}[{p.value.size}];\n")
            for role, b in layer.buffers.items():
                self.decls.append(_array("float", _ident(k, role), b.value, const=False, used=True))
            if layer.op in ("batchnorm", "layernorm"):
                count = layer.shape[1] if layer.op == "batchnorm" else layer.elements // layer.shape[-1]
                self.decls.append(f"static float {_ident(k, 'mean')}[{count}], {_ident(k, 'invstd')}[{count}];\n")
            shape = self.shape_struct(layer, k)
            if shape:
                self.decls.append(shape)

    def shape_struct(self, layer: Layer, k: int) -> str:
        a = layer.attrs
        if layer.op == "conv2d":
            n, c, h, w = layer.operand_shapes[0]
            _, co, ho, wo = layer.shape
            fields = [n, c, h, w, co, ho, wo, *a["kernel"], *a["stride"], *a["padding"], a["groups"]]
            return f"static const poet_conv2d_shape {_ident(k, 'shape')} = {{{', '.join(f'{v}u' for v in fields)}}};\n"
        if layer.op in ("maxpool", "avgpool"):
            n, c, h, w = layer.operand_shapes[0]
            fields = [n, c, h, w, layer.shape[2], layer.shape[3], *a["kernel"], *a["stride"], *a["padding"]]
            return f"static const poet_pool2d_shape {_ident(k, 'shape')} = {{{', '.join(f'{v}u' for v in fields)}}};\n"
        if layer.op == "batchnorm":
            x = layer.operand_shapes[0]
            spatial = math.prod(x[2:]) if len(x) > 2 else 1
            return (f"static const poet_batchnorm_shape {_ident(k, 'shape')} = {{{x[0]}u, {x[1]}u, {spatial}u, "
                    f"{_float(a['eps'])}, {_float(a['momentum'])}}};\n")
        return ""

    # -- kernels ---------------------------------------------------------------------------------

    def forward(self, layer: Layer, out: str, ops: dict[int, int], first: bool) -> list[str]:
        k = self.layer_index[layer.name]
        x = [self.at(ops, o, f"{layer.name}'s forward") for o in layer.operands]
        n = layer.elements
        S = "&" + _ident(k, "shape")
        op = layer.op
        if op == "input":
            return [f"poet_copy({out}, poet_input, {n}u);"]
        if op == "conv2d":
            return [f"poet_conv2d_forward({out}, {x[0]}, {self.param(layer, 'weight')}, {self.param(layer, 'bias')}, {S});"]
        if op == "batchnorm":
            rm, rv = ((_ident(k, "running_mean"), _ident(k, "running_var")) if first and layer.buffers else ("NULL", "NULL"))
            return [f"poet_batchnorm_forward({out}, {_ident(k, 'mean')}, {_ident(k, 'invstd')}, {rm}, {rv}, {x[0]}, "
                    f"{self.param(layer, 'weight')}, {self.param(layer, 'bias')}, {S});"]
        if op == "layernorm":
            d = layer.shape[-1]
            return [f"poet_layernorm_forward({out}, {_ident(k, 'mean')}, {_ident(k, 'invstd')}, {x[0]}, "
                    f"{self.param(layer, 'weight')}, {self.param(layer, 'bias')}, {n // d}u, {d}u, {_float(layer.attrs['eps'])});"]
        if op in ("relu", "relu6", "gelu"):
            return [f"poet_{op}_forward({out}, {x[0]}, {n}u);"]
        if op == "maxpool":
            return [f"poet_maxpool2d_forward({out}, {x[0]}, {S});"]
        if op == "avgpool":
            return [f"poet_avgpool2d_forward({out}, {x[0]}, {S});"]
        if op == "global_avgpool":
            xs = layer.operand_shapes[0]
            return [f"poet_global_avgpool_forward({out}, {x[0]}, {xs[0] * xs[1]}u, {math.prod(xs[2:])}u);"]
        if op == "linear":
            fi, fo = layer.attrs["features_in"], layer.attrs["features_out"]
            return [f"poet_linear_forward({out}, {x[0]}, {self.param(layer, 'weight')}, {self.param(layer, 'bias')}, "
                    f"{n // fo}u, {fi}u, {fo}u);"]
        if op == "add":
            return [f"poet_add_forward({out}, {x[0]}, {x[1]}, {n}u);"]
        if op == "copy":
            return [f"poet_copy({out}, {x[0]}, {n}u);"]
        if op == "softmax":
            d = layer.shape[-1]
            return [f"poet_softmax_forward({out}, {x[0]}, {n // d}u, {d}u);"]
        if op == "matmul":
            return [f"poet_matmul_forward({out}, {x[0]}, {x[1]}, {self.matmul_dims(layer)});"]
        raise PoetError(f"node {layer.name!r}: no kernel for operator {op}", field="--torch")

    def matmul_dims(self, layer: Layer) -> str:
        a, b = layer.operand_shapes
        return f"{math.prod(a[:-2])}u, {a[-2]}u, {a[-1]}u, {b[-1]}u"

    def data_gradient(self, user: Layer, which: int, g: str, ops: dict[int, int], f: str) -> str:
        """g += d(loss)/d(operand `which` of user), from grad:user."""
        k = self.layer_index[user.name]
        gu = self.at(ops, "grad:" + user.name, f"grad:{f} through {user.name}")
        S = "&" + _ident(k, "shape")
        n = user.elements
        op = user.op
        if op == "conv2d":
            return f"poet_conv2d_backward_input({g}, {gu}, {self.param(user, 'weight')}, {S});"
        if op == "batchnorm":
            x = self.at(ops, f, f"{user.name}'s backward")
            return (f"poet_batchnorm_backward({g}, NULL, NULL, {gu}, {x}, {_ident(k, 'mean')}, {_ident(k, 'invstd')}, "
                    f"{self.param(user, 'weight')}, {S});")
        if op == "layernorm":
            x = self.at(ops, f, f"{user.name}'s backward")
            d = user.shape[-1]
            return (f"poet_layernorm_backward({g}, NULL, NULL, {gu}, {x}, {_ident(k, 'mean')}, {_ident(k, 'invstd')}, "
                    f"{self.param(user, 'weight')}, {n // d}u, {d}u);")
        if op == "relu":  # reads its output, as autograd saves it
            return f"poet_relu_backward({g}, {gu}, {self.at(ops, user.name, user.name + ' backward')}, {n}u);"
        if op in ("relu6", "gelu"):
            return f"poet_{op}_backward({g}, {gu}, {self.at(ops, f, user.name + ' backward')}, {n}u);"
        if op == "maxpool":
            return f"poet_maxpool2d_backward({g}, {gu}, {self.at(ops, f, user.name + ' backward')}, {S});"
        if op == "avgpool":
            return f"poet_avgpool2d_backward({g}, {gu}, {S});"
        if op == "global_avgpool":
            xs = user.operand_shapes[0]
            return f"poet_global_avgpool_backward({g}, {gu}, {xs[0] * xs[1]}u, {math.prod(xs[2:])}u);"
        if op == "linear":
            fi, fo = user.attrs["features_in"], user.attrs["features_out"]
            return f"poet_linear_backward_input({g}, {gu}, {self.param(user, 'weight')}, {n // fo}u, {fi}u, {fo}u);"
        if op in ("add", "copy"):
            return f"poet_accumulate({g}, {gu}, {n}u);"
        if op == "softmax":
            d = user.shape[-1]
            return f"poet_softmax_backward({g}, {gu}, {self.at(ops, user.name, user.name + ' backward')}, {n // d}u, {d}u);"
        if op == "matmul":
            other = self.at(ops, user.operands[1 - which], user.name + " backward")
            if which == 0:
                return f"poet_matmul_backward_a({g}, {gu}, {other}, {self.matmul_dims(user)});"
            return f"poet_matmul_backward_b({g}, {other}, {gu}, {self.matmul_dims(user)});"
        raise PoetError(f"node {user.name!r}: no backward kernel for operator {op}", field="--torch")

    def weight_gradient(self, layer: Layer, g: str, ops: dict[int, int]) -> list[str]:
        k = self.layer_index[layer.name]
        x = self.at(ops, layer.operands[0], f"{layer.name}'s weight gradient")
        S = "&" + _ident(k, "shape")
        gw, gb = self.grad(layer, "weight"), self.grad(layer, "bias")
        if layer.op == "conv2d":
            return [f"poet_conv2d_backward_params({gw}, {gb}, {g}, {x}, {S});"]
        if layer.op == "linear":
            fi, fo = layer.attrs["features_in"], layer.attrs["features_out"]
            return [f"poet_linear_backward_params({gw}, {gb}, {g}, {x}, {layer.elements // fo}u, {fi}u, {fo}u);"]
        if layer.op == "batchnorm":
            return [f"poet_batchnorm_backward(NULL, {gw}, {gb}, {g}, {x}, {_ident(k, 'mean')}, {_ident(k, 'invstd')}, "
                    f"{self.param(layer, 'weight')}, {S});"]
        if layer.op == "layernorm":
            d = layer.shape[-1]
            return [f"poet_layernorm_backward(NULL, {gw}, {gb}, {g}, {x}, {_ident(k, 'mean')}, {_ident(k, 'invstd')}, "
                    f"{self.param(layer, 'weight')}, {layer.elements // d}u, {d}u);"]
        raise PoetError(f"node {layer.name!r}: no weight-gradient kernel for operator {layer.op}", field="--torch")

    # -- the step --------------------------------------------------------------------------------

    def step_body(self) -> list[str]:
        lines: list[str] = []
        computed: set[int] = set()
        labels, logits = self.net.layers[self.net.output], self.net.output
        batch, classes = labels.shape[0], labels.elements // labels.shape[0]
        for s, step in enumerate(self.doc["steps"]):
            node = step["node"]
            info = self.nodes[node]
            name, nbytes = info["name"], int(info["bytes"])
            off = self.plan.step_offsets[s]
            out = f"(poet_arena + {off // 4}u)"
            kind = step["op"]
            if kind == "free":
                continue
            if kind == "page_out":
                lines += [f"/* {s}: page out {name} */",
                          f"rc = poet_page_out({self.flash.offsets[node]}u, {out}, {nbytes}u);",
                          "if (rc) return rc;"]
                continue
            if kind == "page_in":
                lines += [f"/* {s}: page in {name} */",
                          f"rc = poet_page_in({self.flash.offsets[node]}u, {out}, {nbytes}u);",
                          "if (rc) return rc;"]
                continue
            first = node not in computed
            computed.add(node)
            ops = dict(zip(info["deps"], self.plan.operand_offsets[s]))
            lines.append(f"/* {s}: {'compute' if first else 'recompute'} {name} */")
            if info["kind"] == "forward":
                lines += self.forward(self.net.layers[name], out, ops, first)
            elif info["kind"] == "loss":
                lines.append(f"poet_cross_entropy_forward({out}, {self.at(ops, logits, 'the loss')}, poet_labels, "
                             f"{batch}u, {classes}u);")
                if first:
                    lines.append(f"*loss = {out}[0];")
            else:
                f = name[len("grad:"):]
                layer = self.net.layers[f]
                lines.append(f"poet_zero({out}, {layer.elements}u);")
                if f == logits:
                    lines.append(f"poet_cross_entropy_backward({out}, {self.at(ops, logits, 'the loss gradient')}, "
                                 f"poet_labels, {batch}u, {classes}u);")
                for user in self.users[f]:
                    for which, operand in enumerate(user.operands):
                        if operand == f:
                            lines.append(self.data_gradient(user, which, out, ops, f))
                if layer.trainable and first:
                    lines += self.weight_gradient(layer, out, ops)
        return lines

    def render(self, steps: int, x: np.ndarray, y: np.ndarray) -> GeneratedStep:
        self.declare()
        zero, sgd = [], []
        for layer in self.net.layers.values():
            if not layer.trainable:
                continue
            k = self.layer_index[layer.name]
            for role, p in layer.params.items():
                zero.append(f"    poet_zero({_ident(k, 'g' + role)}, {p.value.size}u);")
                sgd.append(f"    poet_sgd_step({_ident(k, role)}, {_ident(k, 'g' + role)}, {p.value.size}u, {_float(self.lr)});")
        body = self.step_body()
        arena_words = max(1, -(-self.plan.arena_bytes // 4))
        text = "\n".join([
            f"/* Generated by poet-opt: {steps} training step(s) of {self.net.name} as the schedule says. */",
            "#include <stddef.h>",
            "#include <stdint.h>",
            '#include "poet_kernels.h"',
            '#include "poet_paging.h"',
            "",
            f"#define POET_TRAIN_STEPS {steps}u",
            "",
            f"static float poet_arena[{arena_words}];",
            _array("float", "poet_input", x.astype(np.float32), const=True),
            _array("int32_t", "poet_labels", y.astype(np.int64), const=True),
            *self.decls,
            "__attribute__((used)) float poet_losses[POET_TRAIN_STEPS];",
            "",
            "static int poet_train_step(float *loss)",
            "{",
            "    int rc = 0;",
            *zero,
            *("    " + line for line in body),
            *sgd,
            "    return rc;",
            "}",
            "",
            "int main(void)",
            "{",
            "    uint32_t s;",
            "    for (s = 0; s < POET_TRAIN_STEPS; ++s) {",
            "        int rc = poet_train_step(&poet_losses[s]);",
            "        if (rc) {",
            "            return rc;",
            "        }",
            "    }",
            "    return 0;",
            "}",
            "",
        ])
        return GeneratedStep(text, dict(self.param_symbols), steps)


def generate(network: Network, doc: dict, plan: ArenaPlan, flash: FlashPlan, *, steps: int, lr: float,
             x: np.ndarray, y: np.ndarray) -> GeneratedStep:
    """poet_train.c for ``steps`` SGD steps at ``lr`` on the batch ``x`` with labels ``y``."""
    if any(o % 4 for o in plan.step_offsets) or any(o % 4 for offs in plan.operand_offsets for o in offs):
        raise PoetError(f"device.alignment_bytes is {plan.alignment}; fp32 tensors need offsets that are "
                        "multiples of 4", field="--device")
    return _Writer(network, doc, plan, flash, lr).render(steps, x, y)
