"""C sources that perform training steps exactly as a validated schedule says.

One function, ``poet_train_step``, walks the schedule's steps in order: each compute (first time or
recompute), page-out and page-in at the arena offsets of the export's plan, then one SGD update.
The training graph's semantics (poet_opt.model.zoo) decide what a node computes:

- a forward node runs its layer's kernel;
- ``grad:f`` is the gradient of the loss with respect to f's output: zeroed, then one contribution
  per user u of f (the data gradient back through u, which reads grad:u and what u saved), plus the
  softmax cross-entropy gradient when f is the logits; and when f has trainable weights, their
  gradients, which read f's inputs. Where the first contribution is a convolution's or a linear
  layer's, it writes the buffer instead, and there is no zeroing.

A recompute produces the same bytes as the first compute, but side effects must happen once per
step: running statistics move and weight gradients accumulate only at a node's first compute,
which the generator knows statically. Trainable weights, their gradients and the per-channel
statistics of the norms are static RAM; frozen weights, the batch and its labels are const (flash).

With streamed weights (a graph with ``param:f`` nodes) no weight lives in the image: computing
``param:f`` reads f's region of the storage into the arena, the kernels take the weights from
there, and the node that ``updates`` them folds each weight's gradient straight into an SGD step
(the ``*_backward_params_sgd`` kernels, after the node's data gradients, which need the old
weights) and writes the region back through the page-out path. A frozen layer's region is only
ever read.

A tiled layer (``--weight-tile``) is one layer per slice of its output features, ``L#j``, each a
convolution or linear layer of its own with its rows of the weights in its own region, and a
``concat`` ``L`` that copies the slices into the whole output (``poet_copy_strided``);
``grad:L#j`` is its slice of ``grad:L`` (``poet_accumulate_strided``). The data gradient into L's
input is summed tile by tile over ``grad:x@i`` partial sums, each updating its tile's weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.firmware import program
from poet_opt.firmware.arena import ArenaPlan, FlashPlan
from poet_opt.firmware.c_text import block_comment, comment, float_literal, identifier
from poet_opt.firmware.targets import TRACE_BASE
from poet_opt.model import ops as registry
from poet_opt.model.network import Layer, Network
from poet_opt.schedule.walk import walk_document

KERNEL_FILES = ("poet_kernels_basic.c", "poet_kernels_conv.c", "poet_kernels_norm.c", "poet_kernels_strips.c",
                "poet_kernels_rows.c", "poet_math.c")
# the page-out and page-in over a board's three storage functions (firmware/board/)
PAGING_FILES = ("poet_paging.c",)
# the step's learning rate, input batch and labels: what the caller of the train step passes in
# (library.py sets these statics on entry)
LR = "poet_lr"
# layers whose data-gradient kernel has a form that writes dx instead of adding to it (``_set``)
WRITES_DATA_GRADIENT = ("conv2d", "linear")


@dataclass
class GeneratedStep:
    source: str  # <prefix>train.c
    param_symbols: dict[str, str]  # torch name -> C symbol of each trainable parameter (resident weights)
    steps: int
    # streamed weights: param node -> its layer, whose parameters the node's region holds in order
    param_layers: dict[int, Layer] = field(default_factory=dict)
    # a large step runs as a program of kernel calls (firmware/program.py): its bytes, and where it
    # lies on the storage device (None: in flash, inside the source)
    program: bytes | None = None
    program_offset: int | None = None
    header: str = ""  # <prefix>train.h, the library's interface (library.py)
    harness: str = ""  # poet_harness.c, the example main() the emulator runs
    prefix: str = "poet_"


def streams_weights(doc: dict) -> bool:
    return any(n.get("op") == "param" for n in doc["graph"]["nodes"])


def param_layers(network: Network, doc: dict) -> dict[int, Layer]:
    """The layer whose parameters each ``param:f`` node holds: its ``params`` in order, packed as
    float32 (the region's bytes on storage and the node's slot in the arena)."""
    nodes = doc["graph"]["nodes"]
    out: dict[int, Layer] = {}
    for n, node in enumerate(nodes):
        if node.get("op") != "param":
            continue
        name = str(node["name"])
        if name.startswith("state:"):
            raise PoetError(f"node {name!r}: the firmware updates streamed weights with plain SGD and keeps no "
                            "optimizer state; solve with --optimizer sgd", field="--optimizer")
        layer = network.layers.get(name[len("param:"):]) if name.startswith("param:") else None
        if layer is None:
            raise PoetError(f"internal: the schedule's weights node {name!r} names no layer of the network")
        if layer.op not in ("linear", "conv2d", "batchnorm", "layernorm", "embedding"):
            raise PoetError(f"node {layer.name!r}: no kernel streams the weights of a {layer.op}", field="--torch")
        packed = 4 * sum(p.value.size for p in layer.params.values())
        if packed != int(node["bytes"]):
            raise PoetError(f"internal: {name!r} is {node['bytes']} B in the graph but {layer.name!r} has "
                            f"{packed} B of parameters")
        out[n] = layer
    read = {id(layer) for layer in out.values()}
    for layer in network.layers.values():
        if layer.params and id(layer) not in read:
            raise PoetError(f"internal: layer {layer.name!r} has weights but the schedule never reads them")
    return out


def packed_params(layer: Layer) -> np.ndarray:
    """A layer's parameters as its weights region holds them."""
    return np.concatenate([p.value.astype(np.float32).reshape(-1) for p in layer.params.values()])


def elementwise_kernel(op: str) -> bool:
    """Whether the registry gives ``op`` C kernels of the elementwise convention (OpSpec)."""
    spec = registry.get(op)
    return spec is not None and spec.c_convention == "elementwise" and spec.c_forward is not None


def elementwise_backward(op: str, g: str, gu: str, n: int, at, output: str, operands) -> str:
    """The call dx += f'(saved) dy of an elementwise kernel: ``saved`` is its output or its inputs, as
    the registry says its backward reads (at(tensor name) -> the C pointer to it), or nothing."""
    spec = registry.spec(op)
    saved = [at(output)] if spec.saves == "out" else [at(o) for o in operands] if spec.saves == "in" else []
    return f"{spec.c_backward}({', '.join([g, gu, *saved])}, {n}u);"


# the emulator's trace register (targets.TRACE_BASE): a profiling build only, no board has it
MARK_FUNCTION = [
    "static void poet_mark(uint32_t step)",
    "{",
    f"    *(volatile uint32_t *)0x{TRACE_BASE:08x}u = step;",
    "}",
    "",
]


def ids(at: str) -> str:
    """An arena pointer to token ids as the embedding kernels take them: the input's slot holds the
    int32 bits the caller's batch gave (library.py), copied word for word."""
    return f"(const int32_t *){at}"


def c_float(v: float) -> str:
    return float_literal(v)


def c_array(ctype: str, name: str, values: np.ndarray, *, const: bool, used: bool = False) -> str:
    flat = values.reshape(-1)
    fmt = c_float if ctype == "float" else (lambda v: str(int(v)))
    body = ",\n".join("    " + ", ".join(fmt(v) for v in flat[k:k + 6]) for k in range(0, len(flat), 6))
    # used: the emulator reads the trained values back by symbol, which --gc-sections would drop
    attrs = "__attribute__((used)) " if used else ""
    storage = "static const " if const else "static "
    return f"{attrs}{storage}{ctype} {name}[{max(1, len(flat))}] = {{\n{body or '    0'}\n}};\n"


def c_ident(k: int, role: str) -> str:
    return identifier("poet", role, k)


class StepWriter:
    def __init__(self, network: Network, doc: dict, plan: ArenaPlan, flash: FlashPlan, lr: float,
                 program: bool | str = "auto", marks: bool = False):
        self.net, self.doc, self.plan, self.flash, self.lr = network, doc, plan, flash, float(lr)
        self.program = program  # True, False or "auto": a program past program.PROGRAM_CALLS calls
        # `poet-opt measure` on the emulator: each schedule step first writes its number to the
        # trace register, so that the cycles between two marks are that step's (firmware/profile.py)
        self.marks = marks
        self.nodes = doc["graph"]["nodes"]
        self.by_name = {n["name"]: i for i, n in enumerate(self.nodes)}
        self.layer_index = {name: k for k, name in enumerate(network.layers)}
        self.users: dict[str, list[Layer]] = {name: [] for name in network.layers}
        for layer in network.layers.values():
            for operand in dict.fromkeys(layer.operands):
                self.users[operand].append(layer)
        self.decls: list[str] = []
        self.param_symbols: dict[str, str] = {}
        self.streamed = streams_weights(doc)
        self.param_layers = self.weight_regions() if self.streamed else {}
        self.param_node = {layer.name: n for n, layer in self.param_layers.items()}
        # while predict's forward part is written: batch norm as after model.eval()
        self.evaluating = False

    def weight_regions(self) -> dict[int, Layer]:
        """The layer whose parameters each streamed ``param:`` node's region holds (row tiles cut
        them otherwise: row_codegen.py)."""
        return param_layers(self.net, self.doc)

    # -- operands --------------------------------------------------------------------------------

    def at(self, offsets: dict[int, int], name: str, why: str) -> str:
        node = self.by_name.get(name)
        if node is None or node not in offsets:
            raise PoetError(f"internal: the schedule does not hold {name!r} where {why} needs it")
        return f"(poet_arena + {offsets[node] // 4}u)"

    def param(self, layer: Layer, role: str, ops: dict[int, int]) -> str:
        if role not in layer.params:
            return "NULL"
        if not self.streamed:
            return c_ident(self.layer_index[layer.name], role)
        node = self.param_node[layer.name]
        if node not in ops:
            raise PoetError(f"internal: the schedule does not hold the weights of {layer.name!r} where they are read")
        before = 0
        for other, p in layer.params.items():  # the region packs the parameters in order
            if other == role:
                break
            before += p.value.size
        return f"(poet_arena + {ops[node] // 4 + before}u)"

    def grad(self, layer: Layer, role: str) -> str:
        return c_ident(self.layer_index[layer.name], "g" + role) if role in layer.params else "NULL"

    # -- declarations ----------------------------------------------------------------------------

    def declare(self) -> None:
        for layer in self.net.layers.values():
            k = self.layer_index[layer.name]
            for role, p in layer.params.items():
                if self.streamed:  # on storage, read into the arena where the schedule says
                    break
                name = c_ident(k, role)
                self.decls.append(block_comment(p.torch_name, list(p.value.shape)) + "\n"
                                  + c_array("float", name, p.value, const=not layer.trainable, used=layer.trainable))
                if layer.trainable:
                    self.param_symbols[p.torch_name] = name
                    self.decls.append(f"static float {c_ident(k, 'g' + role)}[{p.value.size}];\n")
            for role, b in layer.buffers.items():
                self.decls.append(c_array("float", c_ident(k, role), b.value, const=False, used=True))
            if layer.op in ("batchnorm", "layernorm"):
                count = layer.shape[1] if layer.op == "batchnorm" else layer.elements // layer.shape[-1]
                self.decls.append(f"static float {c_ident(k, 'mean')}[{count}], {c_ident(k, 'invstd')}[{count}];\n")
            shape = self.shape_struct(layer, k)
            if shape:
                self.decls.append(shape)

    def shape_struct(self, layer: Layer, k: int) -> str:
        a = layer.attrs
        if layer.op == "conv2d":
            n, c, h, w = layer.operand_shapes[0]
            _, co, ho, wo = layer.shape
            fields = [n, c, h, w, co, ho, wo, *a["kernel"], *a["stride"], *a["padding"], a["groups"]]
            return f"static const poet_conv2d_shape {c_ident(k, 'shape')} = {{{', '.join(f'{v}u' for v in fields)}}};\n"
        if layer.op in ("maxpool", "avgpool"):
            n, c, h, w = layer.operand_shapes[0]
            fields = [n, c, h, w, layer.shape[2], layer.shape[3], *a["kernel"], *a["stride"], *a["padding"]]
            return f"static const poet_pool2d_shape {c_ident(k, 'shape')} = {{{', '.join(f'{v}u' for v in fields)}}};\n"
        if layer.op == "batchnorm":
            x = layer.operand_shapes[0]
            spatial = math.prod(x[2:]) if len(x) > 2 else 1
            return (f"static const poet_batchnorm_shape {c_ident(k, 'shape')} = {{{x[0]}u, {x[1]}u, {spatial}u, "
                    f"{c_float(a['eps'])}, {c_float(a['momentum'])}}};\n")
        return ""

    # -- kernels ---------------------------------------------------------------------------------

    def forward(self, layer: Layer, out: str, ops: dict[int, int], first: bool) -> list[str]:
        k = self.layer_index[layer.name]
        x = [self.at(ops, o, f"{layer.name}'s forward") for o in layer.operands]
        n = layer.elements
        S = "&" + c_ident(k, "shape")
        op = layer.op
        if op == "input":
            return [f"poet_copy({out}, poet_input, {n}u);"]
        if op == "conv2d":
            return [f"poet_conv2d_forward({out}, {x[0]}, {self.param(layer, 'weight', ops)}, {self.param(layer, 'bias', ops)}, {S});"]
        if op == "batchnorm" and self.evaluating and layer.buffers:
            xs = layer.operand_shapes[0]
            return [self.batchnorm_eval(layer, out, x[0], ops, xs[0], math.prod(xs[2:]))]
        if op == "batchnorm":
            rm, rv = ((c_ident(k, "running_mean"), c_ident(k, "running_var")) if first and layer.buffers else ("NULL", "NULL"))
            return [f"poet_batchnorm_forward({out}, {c_ident(k, 'mean')}, {c_ident(k, 'invstd')}, {rm}, {rv}, {x[0]}, "
                    f"{self.param(layer, 'weight', ops)}, {self.param(layer, 'bias', ops)}, {S});"]
        if op == "layernorm":
            d = layer.shape[-1]
            return [f"poet_layernorm_forward({out}, {c_ident(k, 'mean')}, {c_ident(k, 'invstd')}, {x[0]}, "
                    f"{self.param(layer, 'weight', ops)}, {self.param(layer, 'bias', ops)}, {n // d}u, {d}u, {c_float(layer.attrs['eps'])});"]
        if elementwise_kernel(op):  # activations, add, copy: the registry's kernel, y = f(x..., n)
            return [f"{registry.spec(op).c_forward}({out}, {', '.join(x)}, {n}u);"]
        if op == "maxpool":
            return [f"poet_maxpool2d_forward({out}, {x[0]}, {S});"]
        if op == "avgpool":
            return [f"poet_avgpool2d_forward({out}, {x[0]}, {S});"]
        if op == "global_avgpool":
            xs = layer.operand_shapes[0]
            return [f"poet_global_avgpool_forward({out}, {x[0]}, {xs[0] * xs[1]}u, {math.prod(xs[2:])}u);"]
        if op == "linear":
            fi, fo = layer.attrs["features_in"], layer.attrs["features_out"]
            return [f"poet_linear_forward({out}, {x[0]}, {self.param(layer, 'weight', ops)}, {self.param(layer, 'bias', ops)}, "
                    f"{n // fo}u, {fi}u, {fo}u);"]
        if op == "softmax":
            d = layer.shape[-1]
            return [f"poet_softmax_forward({out}, {x[0]}, {n // d}u, {d}u);"]
        if op == "embedding":  # the rows of the ids; an id outside the table (refused by the library) reads zeros
            d = layer.shape[-1]
            return [f"poet_zero({out}, {n}u);", f"poet_embedding_forward({out}, {ids(x[0])}, "
                    f"{self.param(layer, 'weight', ops)}, {n // d}u, 0u, {layer.attrs['rows']}u, {d}u);"]
        if op == "matmul":
            return [f"poet_matmul_forward({out}, {x[0]}, {x[1]}, {self.matmul_dims(layer)});"]
        if op == "concat":
            return [f"poet_copy_strided({out} + {lo * inner}u, {tile}, {outer}u, {count}u, {whole}u, {count}u);"
                    for tile, (lo, inner, outer, count, whole) in zip(x, self.slices(layer))]
        raise PoetError(f"node {layer.name!r}: no kernel for operator {op}", field="--torch")

    def batchnorm_eval(self, layer: Layer, out: str, x: str, ops: dict[int, int], n: int, spatial: int) -> str:
        """Batch norm with the running statistics over ``n`` samples of ``spatial`` values a channel
        (PyTorch's eval mode): what predict runs, so that a sample's logits do not depend on its batch."""
        k = self.layer_index[layer.name]
        return (f"poet_batchnorm_eval_forward({out}, {x}, {c_ident(k, 'running_mean')}, {c_ident(k, 'running_var')}, "
                f"{self.param(layer, 'weight', ops)}, {self.param(layer, 'bias', ops)}, {n}u, {layer.shape[1]}u, "
                f"{spatial}u, {c_float(layer.attrs['eps'])});")

    @staticmethod
    def slices(concat: Layer) -> list[tuple[int, int, int, int, int]]:
        """Per tile of a concat: (first feature, floats per feature in a block, blocks, floats of
        the tile per block, floats of the whole per block). The feature axis splits the tensor into
        blocks (one per sample, or per token) in which each tile's features are contiguous."""
        axis = concat.attrs["axis"]
        inner = math.prod(concat.shape[axis + 1:])
        outer = math.prod(concat.shape[:axis])
        whole = concat.shape[axis] * inner
        return [(lo, inner, outer, (hi - lo) * inner, whole) for lo, hi in concat.attrs["bounds"]]

    def matmul_dims(self, layer: Layer) -> str:
        a, b = layer.operand_shapes
        return f"{math.prod(a[:-2])}u, {a[-2]}u, {a[-1]}u, {b[-1]}u"

    def data_gradient(self, user: Layer, which: int, g: str, ops: dict[int, int], f: str, write: bool = False) -> str:
        """g += d(loss)/d(operand `which` of user), from grad:user; ``write`` (a convolution or a linear
        layer only): g = the same, its kernel's ``_set`` form, for the first term of an unzeroed g."""
        if write and user.op not in WRITES_DATA_GRADIENT:
            raise ValueError(f"{user.op} has no kernel that writes its data gradient")
        set_ = "_set" if write else ""
        k = self.layer_index[user.name]
        gu = self.at(ops, "grad:" + user.name, f"grad:{f} through {user.name}")
        S = "&" + c_ident(k, "shape")
        n = user.elements
        op = user.op
        if op == "conv2d":
            return f"poet_conv2d_backward_input{set_}({g}, {gu}, {self.param(user, 'weight', ops)}, {S});"
        if op == "batchnorm":
            x = self.at(ops, f, f"{user.name}'s backward")
            return (f"poet_batchnorm_backward({g}, NULL, NULL, {gu}, {x}, {c_ident(k, 'mean')}, {c_ident(k, 'invstd')}, "
                    f"{self.param(user, 'weight', ops)}, {S});")
        if op == "layernorm":
            x = self.at(ops, f, f"{user.name}'s backward")
            d = user.shape[-1]
            return (f"poet_layernorm_backward({g}, NULL, NULL, {gu}, {x}, {c_ident(k, 'mean')}, {c_ident(k, 'invstd')}, "
                    f"{self.param(user, 'weight', ops)}, {n // d}u, {d}u);")
        if elementwise_kernel(op):  # dx += f'(saved) dy, saved as the registry says the backward reads
            return elementwise_backward(op, g, gu, n, lambda name: self.at(ops, name, user.name + " backward"),
                                        user.name, user.operands)
        if op == "maxpool":
            return f"poet_maxpool2d_backward({g}, {gu}, {self.at(ops, f, user.name + ' backward')}, {S});"
        if op == "avgpool":
            return f"poet_avgpool2d_backward({g}, {gu}, {S});"
        if op == "global_avgpool":
            xs = user.operand_shapes[0]
            return f"poet_global_avgpool_backward({g}, {gu}, {xs[0] * xs[1]}u, {math.prod(xs[2:])}u);"
        if op == "linear":
            fi, fo = user.attrs["features_in"], user.attrs["features_out"]
            return (f"poet_linear_backward_input{set_}({g}, {gu}, {self.param(user, 'weight', ops)}, {n // fo}u, "
                    f"{fi}u, {fo}u);")
        if op == "concat":  # a tile's gradient is its features' share of the whole
            lo, inner, outer, count, whole = self.slices(user)[which]
            return f"poet_accumulate_strided({g}, {gu} + {lo * inner}u, {outer}u, {count}u, {count}u, {whole}u);"
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
        S = "&" + c_ident(k, "shape")
        gw, gb = self.grad(layer, "weight"), self.grad(layer, "bias")
        if layer.op == "conv2d":
            return [f"poet_conv2d_backward_params({gw}, {gb}, {g}, {x}, {S});"]
        if layer.op == "linear":
            fi, fo = layer.attrs["features_in"], layer.attrs["features_out"]
            return [f"poet_linear_backward_params({gw}, {gb}, {g}, {x}, {layer.elements // fo}u, {fi}u, {fo}u);"]
        if layer.op == "embedding":
            d = layer.shape[-1]
            return [f"poet_embedding_backward_params({gw}, {g}, {ids(x)}, {layer.elements // d}u, 0u, "
                    f"{layer.attrs['rows']}u, {d}u);"]
        if layer.op == "batchnorm":
            return [f"poet_batchnorm_backward(NULL, {gw}, {gb}, {g}, {x}, {c_ident(k, 'mean')}, {c_ident(k, 'invstd')}, "
                    f"{self.param(layer, 'weight', ops)}, {S});"]
        if layer.op == "layernorm":
            d = layer.shape[-1]
            return [f"poet_layernorm_backward(NULL, {gw}, {gb}, {g}, {x}, {c_ident(k, 'mean')}, {c_ident(k, 'invstd')}, "
                    f"{self.param(layer, 'weight', ops)}, {layer.elements // d}u, {d}u);"]
        raise PoetError(f"node {layer.name!r}: no weight-gradient kernel for operator {layer.op}", field="--torch")

    def update(self, p: int, ops: dict[int, int]) -> list[str]:
        """Streamed weights: fold the gradient of p's layer into its weights in place (SGD), then
        write them back to their region."""
        layer = self.param_layers[p]
        if not layer.trainable:
            raise PoetError(f"internal: the schedule updates the weights of the frozen layer {layer.name!r}")
        k = self.layer_index[layer.name]
        g = self.at(ops, "grad:" + layer.name, f"{layer.name}'s update")
        x = self.at(ops, layer.operands[0], f"{layer.name}'s update")
        w, b = self.param(layer, "weight", ops), self.param(layer, "bias", ops)
        S, lr = "&" + c_ident(k, "shape"), LR
        if layer.op == "linear":
            fi, fo = layer.attrs["features_in"], layer.attrs["features_out"]
            call = f"poet_linear_backward_params_sgd({w}, {b}, {g}, {x}, {layer.elements // fo}u, {fi}u, {fo}u, {lr});"
        elif layer.op == "conv2d":
            call = f"poet_conv2d_backward_params_sgd({w}, {b}, {g}, {x}, {S}, {lr});"
        elif layer.op == "embedding":
            d = layer.shape[-1]
            call = (f"poet_embedding_backward_params_sgd({w}, {g}, {ids(x)}, {layer.elements // d}u, 0u, "
                    f"{layer.attrs['rows']}u, {d}u, {lr});")
        elif layer.op == "batchnorm":
            call = (f"poet_batchnorm_backward_params_sgd({w}, {b}, {g}, {x}, {c_ident(k, 'mean')}, "
                    f"{c_ident(k, 'invstd')}, {S}, {lr});")
        else:
            d = layer.shape[-1]
            call = (f"poet_layernorm_backward_params_sgd({w}, {b}, {g}, {x}, {c_ident(k, 'mean')}, "
                    f"{c_ident(k, 'invstd')}, {layer.elements // d}u, {d}u, {lr});")
        nbytes = int(self.nodes[p]["bytes"])
        return [call, f"rc = poet_page_out({self.flash.offsets[p]}u, (poet_arena + {ops[p] // 4}u), {nbytes}u);",
                "if (rc) return rc;"]

    # -- the step --------------------------------------------------------------------------------

    def step_body(self, upto: int | None = None, predict: bool = False) -> list[str]:
        """The C of the schedule's steps, or of its first ``upto`` steps; ``predict``: a forward pass
        only, in eval mode: batch norm normalises with its running statistics and moves none (every
        compute is taken for a recompute), and what only the batch's statistics need is left out."""
        self.evaluating = predict
        skip = self.eval_unneeded() if predict else set()
        lines: list[str] = []
        # a forward pass pages out only what it pages back in: the rest is kept for the backward
        # pass, and writing it would wear the storage for nothing
        read_back = {step["node"] for step in self.doc["steps"][:upto] if step["op"] == "page_in"}
        for s, kind, node, first in walk_document(self.doc, upto=upto):
            info = self.nodes[node]
            name, nbytes = info["name"], int(info["bytes"])
            off = self.plan.step_offsets[s]
            out = f"(poet_arena + {off // 4}u)"
            if kind == "free" or node in skip:
                continue
            if kind == "page_out" and predict and node not in read_back:
                continue
            if self.marks and not predict:
                lines.append(f"poet_mark({s}u);")
            if kind == "page_out":
                lines += [block_comment(f"{s}: page out", name),
                          f"rc = poet_page_out({self.flash.offsets[node]}u, {out}, {nbytes}u);",
                          "if (rc) return rc;"]
                continue
            if kind == "page_in":
                lines += [block_comment(f"{s}: page in", name),
                          f"rc = poet_page_in({self.flash.offsets[node]}u, {out}, {nbytes}u);",
                          "if (rc) return rc;"]
                continue
            first = first and not predict
            ops = dict(zip(info["deps"], self.plan.operand_offsets[s]))
            lines.append(block_comment(f"{s}: {'compute' if first else 'recompute'}", name))
            lines += self.compute(node, info, out, ops, first)
        if self.marks and not predict:  # closes the last step
            lines.append(f"poet_mark({len(self.doc['steps'])}u);")
        self.evaluating = False
        return lines

    def eval_unneeded(self) -> set[int]:
        """The nodes a forward pass in eval mode need not compute: whole tensors keep the batch's
        statistics outside the arena, so none here (strip plans hold them in nodes)."""
        return set()

    def finish(self, lines: list[str]) -> None:
        """Settle the declarations once every body that uses them (``lines``) is written."""

    def logits_step(self) -> int:
        """The schedule's first compute of the logits: the end of its forward part."""
        want = self.by_name.get(self.net.output)
        for s, step in enumerate(self.doc["steps"]):
            if step["op"] == "compute" and step["node"] == want:
                return s
        raise PoetError(f"internal: the schedule never computes the logits {self.net.output!r}")

    def compute(self, node: int, info: dict, out: str, ops: dict[int, int], first: bool) -> list[str]:
        """The C of one compute of ``node`` into ``out`` (its operands at ``ops``), updates included."""
        lines: list[str] = []
        name, nbytes = info["name"], int(info["bytes"])
        labels, logits = self.net.layers[self.net.output], self.net.output
        batch, classes = labels.shape[0], labels.elements // labels.shape[0]
        if info.get("op") == "param":
            lines += [f"rc = poet_page_in({self.flash.offsets[node]}u, {out}, {nbytes}u);", "if (rc) return rc;"]
        elif info["kind"] == "forward":
            lines += self.forward(self.net.layers[name], out, ops, first)
        elif info["kind"] == "loss":
            lines.append(f"poet_cross_entropy_forward({out}, {self.at(ops, logits, 'the loss')}, poet_labels, "
                         f"{batch}u, {classes}u);")
            if first:
                lines.append(f"*loss = {out}[0];")
        elif name.startswith("update:"):
            pass  # the update alone, below
        else:
            f = self.gradient_of(name)
            layer = self.net.layers[f]
            users = self.users[f]
            partial = [d for d in info["deps"] if self.gradient_of(str(self.nodes[d]["name"])) == f
                       and self.nodes[d]["name"] != "grad:" + f]
            if self.streamed:
                # streamed weights may split the sum over the users into a chain of nodes (one
                # user's weights in RAM at a time): this node adds the users whose gradient it reads
                users = [u for u in users if self.by_name.get("grad:" + u.name) in info["deps"]]
            loss = f == logits and name == "grad:" + f  # once: not again in a partial sum
            terms = [(user, which) for user in users for which, operand in enumerate(user.operands) if operand == f]
            if partial:  # the sum so far, from the partial node before this one
                lines.append(f"poet_copy({out}, {self.at(ops, self.nodes[partial[0]]['name'], name)}, "
                             f"{layer.elements}u);")
            elif not loss and terms and terms[0][0].op in WRITES_DATA_GRADIENT:
                # the first term writes the buffer (dx =): no zeroing, and a depthwise layer's walk
                # or a classifier head's row neither loads nor zeroes dx
                user, which = terms.pop(0)
                lines.append(self.data_gradient(user, which, out, ops, f, write=True))
            else:
                lines.append(f"poet_zero({out}, {layer.elements}u);")
            if loss:
                lines.append(f"poet_cross_entropy_backward({out}, {self.at(ops, logits, 'the loss gradient')}, "
                             f"poet_labels, {batch}u, {classes}u);")
            for user, which in terms:
                lines.append(self.data_gradient(user, which, out, ops, f))
            if layer.trainable and first and not self.streamed:
                lines += self.weight_gradient(layer, out, ops)
        for p in info.get("updates", ()):  # after the data gradients, which read the old weights
            lines += self.update(p, ops)
        return lines

    def gradient_of(self, name: str) -> str | None:
        """The layer whose gradient node ``name`` is (or a partial sum of, ``grad:x@i``): a layer's
        own name first, since a name may hold "@" itself (node names are unique: codegen.generate)."""
        if not name.startswith("grad:"):
            return None
        whole = name[len("grad:"):]
        return whole if whole in self.net.layers else whole.rpartition("@")[0]

    def weights_comment(self) -> list[str]:
        """Where the board must have each layer's weights before the first step (float32, the
        parameters one after the other)."""
        if not self.streamed:
            return []
        rows = []
        for n, layer in self.param_layers.items():
            names = ", ".join(f"{p.torch_name}{p.where()} {list(p.value.shape)}" for p in layer.params.values())
            what = "read and rewritten each step" if layer.trainable else "read only (frozen)"
            rows.append(f" * {self.flash.offsets[n]:>12} {int(self.nodes[n]['bytes']):>10}  {comment(names)}; {what}")
        return ["/* Streamed weights on the storage device, provisioned before the first step:",
                " *       offset      bytes  parameters (float32, in this order)", *rows, " */", ""]

    def as_program(self, body: list[str]):
        """(the step's statements, the interpreter's C, the program's bytes, its storage offset): the
        body itself when it is small (or ``program`` is False), else a call to the program."""
        calls = sum(1 for line in body if line.startswith("poet_") or line.startswith("rc = "))
        if self.program is False or self.program == "auto" and calls <= program.PROGRAM_CALLS:
            return body, [], None, None
        step = program.encode(program.parse_step(body))
        offset = None
        if len(step.code) > program.FLASH_PROGRAM_BYTES and self.streamed:
            capacity = (self.doc.get("device") or {}).get("storage_capacity_bytes")
            offset = program.storage_offset(self.flash, capacity if isinstance(capacity, int) else None,
                                            len(step.code))
        return (["rc = poet_run_program(loss);", "if (rc) return rc;"],
                program.interpreter(step, storage_offset=offset), step.code, offset)
