"""Model zoo: training graphs of well-known networks at operator granularity.

Each model declares its forward operators on a small builder (:class:`_Net`); one generic function
(:func:`_training_graph`) derives the loss and the Checkmate-style backward graph from them, so the
backward rules live in one place. Sizes are per operator as a framework would run it (conv, BN and
ReLU stay separate: the cheap element-wise nodes are what a rematerialization solver recomputes).

Modelling choices: dropout and attention masks are left out (no dropout nodes); views (flatten,
reshape, head split, taking the [CLS] token) are free and get no node; BN running statistics are
buffers, not parameters, and are not counted. Token ids are sized with ``bytes_per_element`` like
every other tensor.
"""

from __future__ import annotations

import difflib
import math
import operator
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from poet_opt.errors import PoetError
from poet_opt.model import ops as registry
from poet_opt.model.graph import Node, TrainingGraph


@dataclass(frozen=True)
class _Op:
    name: str
    op: str
    shape: tuple[int, ...]  # one sample's output tensor
    inputs: tuple[int, ...]
    flops: float  # one sample, forward
    params: int = 0
    # What back-propagating through this op into one of its inputs reads besides the output
    # gradient: "in" (its inputs), "out" (its own output), "other" (the other operand of a product
    # of two activations) or "" (nothing: weights are parameters, add only routes gradients);
    # "in+out" joins two.
    saves: str = ""
    # (kernel, stride, padding) along H and W of a convolution or pooling: what a strip of its output
    # reads of its input (model/strips.py); () when unknown (importers) or not a window.
    window: tuple[int, ...] = ()

    @property
    def elements(self) -> int:
        return math.prod(self.shape)




class _Net:
    """Collects forward operators in execution order; op 0 is the input tensor."""

    def __init__(self, input_shape: Sequence[int]):
        self.ops = [_Op("input", "input", tuple(input_shape), (), 0.0)]

    def shape(self, x: int) -> tuple[int, ...]:
        return self.ops[x].shape

    def _add(self, name, op, inputs, shape, flops, params=0, saves="", window=()) -> int:
        if min(shape) < 1:
            raise PoetError(f"the input is too small for this model: {name} would have shape {shape}",
                            field="--input-shape")
        assert all(o.name != name for o in self.ops), name
        self.ops.append(_Op(name, op, tuple(shape), tuple(inputs), float(flops), params, saves, tuple(window)))
        return len(self.ops) - 1

    def conv(self, x, name, cout, k, stride=1, groups=1, bias=False):
        cin, h, w = self.shape(x)
        groups = cin if groups == "depthwise" else groups
        ho, wo = ((d + 2 * (k // 2) - k) // stride + 1 for d in (h, w))
        weights = cout * (cin // groups) * k * k
        return self._add(name, "conv2d", (x,), (cout, ho, wo), 2 * weights * ho * wo,
                         weights + (cout if bias else 0), window=(k, stride, k // 2))

    def bn(self, x, name):
        return self._per_element(x, name, "batchnorm", 2 * self.shape(x)[0])

    def act(self, x, name, fn="relu"):
        return self._per_element(x, name, fn)

    def _per_element(self, x, name, op, params=0):
        """An operator of x's shape whose FLOPs per element and backward reads the registry says."""
        spec = registry.spec(op)
        return self._add(name, op, (x,), self.shape(x), spec.flops(math.prod(self.shape(x))), params, spec.saves)

    def add(self, a, b, name):
        assert self.shape(a) == self.shape(b), (name, self.shape(a), self.shape(b))
        return self._add(name, "add", (a, b), self.shape(a), math.prod(self.shape(a)))

    def maxpool(self, x, name, k, stride, pad):
        c, h, w = self.shape(x)
        ho, wo = ((d + 2 * pad - k) // stride + 1 for d in (h, w))
        return self._add(name, "maxpool", (x,), (c, ho, wo), k * k * c * ho * wo, saves="in", window=(k, stride, pad))

    def avgpool(self, x, name, out_hw=None):
        """Global average pooling to (C,), or adaptive pooling to (C, *out_hw)."""
        shape = (self.shape(x)[0],) + tuple(out_hw or ())
        h = self.shape(x)[1] if len(self.shape(x)) == 3 else 0
        even = len(shape) == 3 and h % shape[1] == 0 and h // shape[1] == self.shape(x)[2] // shape[2] and \
            self.shape(x)[2] % shape[2] == 0  # then adaptive pooling is a plain k x k window
        window = (h // shape[1], h // shape[1], 0) if even else ()
        return self._add(name, "avgpool", (x,), shape, math.prod(self.shape(x)), window=window)

    def linear(self, x, name, out, cls_token=False):
        """A (C,H,W) input is flattened; a (seq, d) input is projected token by token, or only its
        first token when ``cls_token`` (BERT's pooler)."""
        shape = self.shape(x)
        if len(shape) == 3:
            rows, fan_in, out_shape = 1, math.prod(shape), (out,)
        elif cls_token:
            rows, fan_in, out_shape = 1, shape[-1], (out,)
        else:
            rows, fan_in, out_shape = math.prod(shape[:-1]), shape[-1], shape[:-1] + (out,)
        return self._add(name, "linear", (x,), out_shape, 2 * rows * fan_in * out, fan_in * out + out)

    def layernorm(self, x, name):
        return self._per_element(x, name, "layernorm", 2 * self.shape(x)[-1])

    def softmax(self, x, name):
        return self._per_element(x, name, "softmax")

    def matmul(self, a, b, name, shape, macs):
        return self._add(name, "matmul", (a, b), shape, 2 * macs, saves="other")

    def embedding(self, x, name, rows, dim):
        shape = self.shape(x) + (dim,)
        return self._add(name, "embedding", (x,), shape, math.prod(shape), rows * dim)


# -- models ----------------------------------------------------------------------------------------

def _mlp(net: _Net) -> None:
    x = 0
    for i in (1, 2, 3):
        x = net.act(net.linear(x, f"fc{i}", 256), f"relu{i}")
    net.linear(x, "fc4", 10)


def _mlp_residual(net: _Net) -> None:
    # The smallest network with a skip connection, small enough that tests/test_c_execution.py
    # solves it to optimality in seconds and runs its training step in C.
    x = net.act(net.linear(0, "fc_in", 256), "relu_in")
    y = net.linear(net.act(net.linear(x, "block.fc1", 256), "block.relu1"), "block.fc2", 256)
    x = net.act(net.add(x, y, "block.add"), "block.relu2")
    net.linear(x, "fc_out", 10)


VGG16_CHANNELS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _vgg16(net: _Net, imagenet: bool) -> None:
    # VGG-16 with batch norm (torchvision's vgg16_bn; the usual CIFAR recipe needs BN to train).
    x, stage, i = 0, 1, 1
    for v in VGG16_CHANNELS:
        if v == "M":
            x = net.maxpool(x, f"pool{stage}", 2, 2, 0)
            stage, i = stage + 1, 1
            continue
        x = net.conv(x, f"conv{stage}_{i}", v, 3, bias=True)
        x = net.act(net.bn(x, f"bn{stage}_{i}"), f"relu{stage}_{i}")
        i += 1
    if not imagenet:
        net.linear(x, "fc", 10)
        return
    if net.shape(x)[1:] != (7, 7):  # torchvision pools to 7x7 so fc6 keeps its size at any input
        x = net.avgpool(x, "avgpool", (7, 7))
    x = net.act(net.linear(x, "fc6", 4096), "relu6")
    x = net.act(net.linear(x, "fc7", 4096), "relu7")
    net.linear(x, "fc8", 1000)


def _basic_block(net: _Net, x: int, p: str, width: int, stride: int) -> int:
    y = net.act(net.bn(net.conv(x, f"{p}.conv1", width, 3, stride), f"{p}.bn1"), f"{p}.relu1")
    y = net.bn(net.conv(y, f"{p}.conv2", width, 3), f"{p}.bn2")
    return net.act(net.add(y, _shortcut(net, x, p, width, stride), f"{p}.add"), f"{p}.relu2")


def _bottleneck(net: _Net, x: int, p: str, width: int, stride: int) -> int:
    # torchvision's ResNet v1.5: the stride sits on the 3x3 conv.
    y = net.act(net.bn(net.conv(x, f"{p}.conv1", width, 1), f"{p}.bn1"), f"{p}.relu1")
    y = net.act(net.bn(net.conv(y, f"{p}.conv2", width, 3, stride), f"{p}.bn2"), f"{p}.relu2")
    y = net.bn(net.conv(y, f"{p}.conv3", 4 * width, 1), f"{p}.bn3")
    return net.act(net.add(y, _shortcut(net, x, p, 4 * width, stride), f"{p}.add"), f"{p}.relu3")


def _shortcut(net: _Net, x: int, p: str, cout: int, stride: int) -> int:
    if stride == 1 and net.shape(x)[0] == cout:
        return x
    return net.bn(net.conv(x, f"{p}.downsample.0", cout, 1, stride), f"{p}.downsample.1")


def _resnet(net: _Net, block: Callable, depths: Sequence[int], cifar: bool) -> None:
    if cifar:  # the CIFAR variant keeps 32x32 through layer1: 3x3 stem, no max-pool
        x = net.act(net.bn(net.conv(0, "conv1", 64, 3), "bn1"), "relu")
    else:
        x = net.act(net.bn(net.conv(0, "conv1", 64, 7, 2), "bn1"), "relu")
        x = net.maxpool(x, "maxpool", 3, 2, 1)
    for stage, (width, n) in enumerate(zip((64, 128, 256, 512), depths), 1):
        for b in range(n):
            x = block(net, x, f"layer{stage}.{b}", width, 2 if stage > 1 and b == 0 else 1)
    net.linear(net.avgpool(x, "avgpool"), "fc", 10 if cifar else 1000)


def _mobilenetv2(net: _Net) -> None:
    x = net.act(net.bn(net.conv(0, "stem.conv", 32, 3, 2), "stem.bn"), "stem.relu", "relu6")
    k = 0
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            p, cin, stride = f"block{k}", net.shape(x)[0], s if i == 0 else 1
            y = x
            if t != 1:
                y = net.conv(y, f"{p}.expand", cin * t, 1)
                y = net.act(net.bn(y, f"{p}.expand_bn"), f"{p}.expand_relu", "relu6")
            y = net.conv(y, f"{p}.dw", net.shape(y)[0], 3, stride, groups="depthwise")
            y = net.act(net.bn(y, f"{p}.dw_bn"), f"{p}.dw_relu", "relu6")
            y = net.bn(net.conv(y, f"{p}.project", c, 1), f"{p}.project_bn")
            x = net.add(x, y, f"{p}.add") if stride == 1 and cin == c else y
            k += 1
    x = net.act(net.bn(net.conv(x, "head.conv", 1280, 1), "head.bn"), "head.relu", "relu6")
    net.linear(net.avgpool(x, "avgpool"), "classifier", 1000)


def _mcu_vww(net: _Net) -> None:
    # MobileNetV1's first seven layers at width 0.125, striding early so that plain training fits
    # in about 250 KB of SRAM at fp32 (person / no person).
    x = net.act(net.bn(net.conv(0, "conv0", 4, 3, 2), "bn0"), "relu0")
    for i, (cout, stride) in enumerate(((8, 2), (16, 2), (32, 2), (32, 1), (64, 2), (64, 1)), 1):
        p = f"ds{i}"
        x = net.conv(x, f"{p}.dw", net.shape(x)[0], 3, stride, groups="depthwise")
        x = net.act(net.bn(x, f"{p}.dw_bn"), f"{p}.dw_relu")
        x = net.act(net.bn(net.conv(x, f"{p}.pw", cout, 1), f"{p}.pw_bn"), f"{p}.pw_relu")
    net.linear(net.avgpool(x, "avgpool"), "fc", 2)


def _encoder_block(net: _Net, x: int, p: str, d=768, heads=12, d_ff=3072) -> int:
    # Post-LN, as BERT. The 1/sqrt(d_head) scaling is folded into the scores matmul.
    seq = net.shape(x)[0]
    q, k, v = (net.linear(x, f"{p}.attn.{w}", d) for w in "qkv")
    scores = net.matmul(q, k, f"{p}.attn.scores", (heads, seq, seq), seq * seq * d)
    probs = net.softmax(scores, f"{p}.attn.softmax")
    ctx = net.matmul(probs, v, f"{p}.attn.context", (seq, d), seq * seq * d)
    out = net.linear(ctx, f"{p}.attn.out", d)
    x = net.layernorm(net.add(x, out, f"{p}.attn.add"), f"{p}.attn.ln")
    h = net.act(net.linear(x, f"{p}.ffn.fc1", d_ff), f"{p}.ffn.gelu", "gelu")
    h = net.linear(h, f"{p}.ffn.fc2", d)
    return net.layernorm(net.add(x, h, f"{p}.ffn.add"), f"{p}.ffn.ln")


def _bert_base(net: _Net) -> None:
    seq = net.shape(0)[0]
    if seq > 512:
        raise PoetError(f"BERT-base has 512 position embeddings; a sequence of {seq} is too long",
                        field="--input-shape")
    # Position and token-type tables are both indexed by position here: one gather, one add.
    x = net.add(net.embedding(0, "embeddings.word", 30522, 768),
                net.embedding(0, "embeddings.position_type", 512 + 2, 768), "embeddings.add")
    x = net.layernorm(x, "embeddings.ln")
    for i in range(12):
        x = _encoder_block(net, x, f"layer{i}")
    x = net.act(net.linear(x, "pooler.dense", 768, cls_token=True), "pooler.tanh", "tanh")
    net.linear(x, "classifier", 2)


def _hidden_states(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], 768)  # a lone encoder block reads hidden states, not token ids


# name -> (description, default input shape, input shape -> the input tensor's shape, declare layers)
_ZOO: dict[str, tuple[str, tuple[int, ...], Callable | None, Callable[[_Net], None]]] = {
    "mlp": ("784-256-256-256-10 multilayer perceptron with ReLU (MNIST-sized)", (784,), None, _mlp),
    "mlp-residual": ("784-256-256-256-10 MLP whose middle two layers form a residual block (one skip connection)",
                     (784,), None, _mlp_residual),
    "vgg16-cifar": ("VGG-16 with batch norm, CIFAR-10 (3x32x32, 10 classes)", (3, 32, 32), None,
                    lambda net: _vgg16(net, imagenet=False)),
    "vgg16-imagenet": ("VGG-16 with batch norm, ImageNet (3x224x224, 1000 classes)", (3, 224, 224), None,
                       lambda net: _vgg16(net, imagenet=True)),
    "resnet18-cifar": ("ResNet-18, CIFAR variant: 3x3 stem, no max-pool (3x32x32, 10 classes)", (3, 32, 32),
                       None, lambda net: _resnet(net, _basic_block, (2, 2, 2, 2), cifar=True)),
    "resnet18-imagenet": ("ResNet-18, ImageNet (3x224x224, 1000 classes)", (3, 224, 224), None,
                          lambda net: _resnet(net, _basic_block, (2, 2, 2, 2), cifar=False)),
    "resnet50": ("ResNet-50 v1.5, ImageNet (3x224x224, 1000 classes)", (3, 224, 224), None,
                 lambda net: _resnet(net, _bottleneck, (3, 4, 6, 3), cifar=False)),
    "mobilenetv2": ("MobileNetV2 width 1.0, ImageNet (3x224x224, 1000 classes)", (3, 224, 224), None,
                    _mobilenetv2),
    "mcu-vww": ("tiny depthwise-separable CNN for visual wake words on a microcontroller (1x96x96, 2 classes)",
                (1, 96, 96), None, _mcu_vww),
    "transformer-block": ("one post-LN encoder block: d_model 768, 12 heads, d_ff 3072 (seq 128)", (128,),
                          _hidden_states, lambda net: _encoder_block(net, 0, "block")),
    "bert-base": ("BERT-base: embeddings, 12 encoder blocks, pooler and a 2-class head (seq 128)", (128,),
                  None, _bert_base),
}

MODELS: dict[str, str] = {name: spec[0] for name, spec in _ZOO.items()}


def build_model(name: str, *, batch_size: int = 1, input_shape=None, bytes_per_element: int = 4,
                trainable="all", weights: str = "resident", optimizer: str = "none",
                tile_bytes: int | None = None, strips=None, rows=None) -> TrainingGraph:
    """The training graph of a zoo model. ``input_shape`` is (C, H, W) for CNNs, (features,) for the
    MLP, (seq_len,) for transformers; it may also be a string such as ``"3x64x64"`` or ``"256"``.
    ``trainable`` is ``"all"``, ``"last:N"`` (the last N operators that have parameters) or node
    names (a list or a comma-separated string; ``layer4`` also selects ``layer4.*``). ``strips``
    (streamed weights only): split every (C, H, W) tensor into that many strips along H (at most
    H), or a dict {H: strips} per height (model/strips.py). ``rows`` (streamed weights, transformers):
    a row tiling {"blocks", "piece", "vocab_rows"} of the (seq, d) tensors (model/rows.py), or
    {"budget": bytes} (and "blocks") for the tiling with the fewest nodes that fits it: None when none does."""
    key = _model_key(name)
    description, default_shape, to_builder, declare = _ZOO[key]
    batch_size = _positive_int(batch_size, "--batch-size")
    bytes_per_element = _positive_int(bytes_per_element, "--bytes-per-element")
    shape, batch_in_shape = _input_shape(input_shape, default_shape)
    if batch_in_shape is not None:
        if batch_size not in (1, batch_in_shape):
            raise PoetError(f"the input shape's batch is {batch_in_shape}, --batch-size says {batch_size}; give one",
                            field="--batch-size")
        batch_size = batch_in_shape
    net = _Net(to_builder(shape) if to_builder else shape)
    declare(net)
    meta = {"model": key, "description": description, "batch_size": batch_size, "input_shape": list(shape),
            "bytes_per_element": bytes_per_element, "forward_layers": len(net.ops) - 1}
    return _training_graph(key, net.ops, batch_size, bytes_per_element, trainable, meta, weights=weights,
                           optimizer=optimizer, tile_bytes=tile_bytes, strips=strips, rows=rows)


def _model_key(name) -> str:
    key = str(name).strip().lower().replace("_", "-")
    if key in _ZOO:
        return key
    bare = re.sub(r"[^a-z0-9]", "", key)  # "ResNet-18" should find resnet18-*
    close = [n for n in _ZOO if bare and bare in re.sub(r"[^a-z0-9]", "", n)] or \
        difflib.get_close_matches(key, _ZOO, n=3, cutoff=0.6)
    hint = f"did you mean {_either(close)}?" if close else f"known models: {', '.join(_ZOO)}"
    raise PoetError(f"unknown model {name!r}; {hint}", field="--model")


def _either(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _positive_int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoetError(f"must be a positive whole number, got {value!r}", field=field)
    return value


def _input_shape(value, default: tuple[int, ...]) -> tuple[tuple[int, ...], int | None]:
    """(one sample's shape, the batch when the value is the whole input, batch first, as for
    --torch and --onnx: ``4,3,32,32``; None for the per-sample form ``3x32x32``)."""
    if value is None:
        return default, None
    if isinstance(value, str):
        parts: list = [p for p in re.split(r"[x,\s()\[\]]+", value.strip().lower()) if p]
    else:
        parts = [value] if isinstance(value, int) else list(value)
    try:
        shape = tuple(int(p) if isinstance(p, str) and p.isdigit() else _whole(p) for p in parts)
    except (TypeError, ValueError):
        shape = ()
    if len(shape) not in (len(default), len(default) + 1) or min(shape, default=0) < 1:
        expected = "C,H,W" if len(default) == 3 else "seq_len or features"
        raise PoetError(f"expected the whole input, batch first (N,{expected}), or one sample ({expected}) in "
                        f"positive whole numbers, got {value!r}", field="--input-shape")
    if len(shape) == len(default) + 1:
        return shape[1:], shape[0]
    return shape, None


def _whole(p) -> int:
    if isinstance(p, bool):
        raise TypeError(p)
    return operator.index(p)  # ints (numpy's too), not floats


def _resolve_trainable(ops: Sequence[_Op], spec) -> set[int]:
    weighted = [i for i, o in enumerate(ops) if o.params]
    if not isinstance(spec, (str, list, tuple, set, type(None))):
        raise PoetError(f"expected all, last:N or layer names, got {spec!r}", field="--trainable")
    if spec is None or isinstance(spec, str) and spec.strip().lower() == "all":
        return set(weighted)
    if isinstance(spec, str) and spec.strip().lower().startswith("last:"):
        count = spec.strip()[5:]
        if not count.isdigit() or int(count) < 1:
            raise PoetError(f"'last:N' needs a positive whole number N, got {spec!r}", field="--trainable")
        return set(weighted[-int(count):])
    names = [str(n).strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if str(n).strip()]
    if not names or names == ["none"]:
        raise PoetError("nothing would be trained; give all, last:N or layer names", field="--trainable")
    chosen: set[int] = set()
    for want in names:
        hits = [i for i in weighted if ops[i].name == want or ops[i].name.startswith(want + ".")]
        if not hits:
            close = difflib.get_close_matches(want, [ops[i].name for i in weighted], n=4, cutoff=0.5)
            hint = f"; did you mean {_either(close)}?" if close else ""
            without = any(o.name == want for o in ops)
            problem = "has no parameters" if without else "is not a layer of this model"
            raise PoetError(f"{want!r} {problem}{hint}", field="--trainable")
        chosen.update(hits)
    return chosen


WEIGHTS = ("resident", "streamed")


def _training_graph(name: str, ops: Sequence[_Op], batch: int, bpe: int, trainable, meta: dict, *,
                    weights: str = "resident", optimizer: str = "none", tile_bytes: int | None = None,
                    strips=None, rows=None) -> TrainingGraph:
    """Forward nodes, a loss on the last op, then one ``grad:f`` node per forward op f whose output
    gradient some trainable weight needs, in reverse forward order.

    ``weights="streamed"`` (docs/streaming.md) puts the weights in the plan: a ``param:f`` node, read
    from storage, feeds f and every gradient node that back-propagates through f; each trained
    layer's weight gradient is folded straight into its weights by the optimizer (``optimizer``,
    SGD when "none"), inside the last node that reads the old weights, which then writes them back.
    No weight gradient is ever held whole. ``tile_bytes`` (streamed only): a layer with more weights
    than that is split into slices of its output features (model/tiling.py), and a gradient that
    several weighted layers feed is summed one layer at a time (``grad:x@i`` partial sums), so no
    node needs more than one slice of weights."""
    if weights not in WEIGHTS:
        raise PoetError(f"unknown weights placement {weights!r}; choose {' or '.join(WEIGHTS)}", field="--weights")
    streamed = weights == "streamed"
    train = _resolve_trainable(ops, trainable)
    if rows is not None:
        return _tiled_graph(name, ops, batch, bpe, trainable, train, meta, streamed, optimizer, rows=rows)
    tiles: dict = {}  # layer -> its WeightSlices
    if streamed and tile_bytes is not None:
        from poet_opt.model.tiling import tile_weights

        ops, train, tiles = tile_weights(ops, train, bpe, tile_bytes)
        # the plan file keeps it: `run --schedule` and `emulate` lower the network again, slices alike
        meta = {**meta, "weight_tile_bytes": int(tile_bytes)}
    needs_grad = []
    for i, o in enumerate(ops):  # inputs come first, so one pass settles "f or an ancestor trains"
        needs_grad.append(i in train or any(needs_grad[j] for j in o.inputs))
    if strips is not None:
        from poet_opt.model.strips import strip_counts, strip_graph

        if not streamed or (optimizer or "none") not in ("none", "sgd"):
            raise PoetError("activation strips need streamed weights and plain SGD", field="--strips")
        meta = {**meta, "trainable": trainable if isinstance(trainable, str) or trainable is None else list(trainable),
                "param_count": sum(o.params for o in ops), "trainable_param_count": sum(ops[i].params for i in train),
                "weights": "streamed", "optimizer": "sgd", "optimizer_state_bytes": 0, "tiles": tiles}
        return strip_graph(name, ops, batch, bpe, train, needs_grad, meta, strip_counts(ops, strips))
    users: list[list[int]] = [[] for _ in ops]
    for i, o in enumerate(ops):
        for j in o.inputs:
            users[j].append(i)
    logits = len(ops) - 1
    assert all(users[i] for i in range(logits)), "every forward op but the last must feed another"

    def size(i: int) -> int:
        return ops[i].elements * bpe * batch

    next_id = len(ops) + 1

    def new_id() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    nodes: list[Node] = []
    param: dict[int, int] = {}  # forward op -> its param node
    for i, o in enumerate(ops):
        deps = o.inputs
        if streamed and o.params:
            param[i] = new_id()
            nodes.append(Node(param[i], f"param:{o.name}", "forward", o.params * bpe, (), 0.0, "param", 0, i in train))
            deps = (*deps, param[i])
        nodes.append(Node(i, o.name, "forward", size(i), deps, o.flops * batch, o.op,
                          0 if streamed else o.params * bpe, i in train))
    loss = len(ops)
    nodes.append(Node(loss, "loss", "loss", bpe * batch, (logits,), 5.0 * ops[logits].elements * batch, "loss"))

    update = _Updates(ops, train, needs_grad, param, bpe, batch, optimizer) if streamed else None
    def through(u: int, f: int) -> set[int]:
        """What the data gradient back through u into f reads besides grad:u."""
        deps = {param[u]} if u in param else set()  # u's weights
        for rule in ops[u].saves.split("+"):  # e.g. "in+out": fused attention keeps both
            deps |= {"in": set(ops[u].inputs), "out": {u}, "other": set(ops[u].inputs) - {f}}.get(rule, set())
        return deps

    grad: dict[int, int] = {}
    for f in reversed(range(len(ops))):
        if not needs_grad[f]:
            continue
        # Streamed weights: with several weighted users, all but the last are summed into partial
        # gradients one user at a time, so their weights pass through RAM one slice after another.
        chain = [u for u in users[f] if u in param][:-1] if streamed else []
        partial = None
        for step, u in enumerate(chain):
            fused = update.fused_into(f, grad, [u])
            nodes += fused.state_nodes(new_id)
            deps = {grad[u]} | through(u, f) | fused.deps | ({partial} if partial is not None else set())
            partial = new_id()
            nodes.append(Node(partial, f"grad:{ops[f].name}@{step}", "backward", size(f), tuple(sorted(deps)),
                              ops[u].flops * batch + fused.flops, f"{ops[f].op}_grad_part",
                              updates=fused.updates, writes_bytes=fused.writes))
        deps: set[int] = set() if partial is None else {partial}
        flops = 0.0
        if f == logits:  # the loss gradient reads the logits (softmax minus target)
            deps |= {loss, logits}
            flops += 2.0 * ops[logits].elements
        rest = [u for u in users[f] if u not in chain]
        for u in rest:  # dL/df = sum over users of the data gradient back through u
            deps.add(grad[u])
            flops += ops[u].flops
            deps |= through(u, f)
        if f in train and not streamed:  # the weight gradient, written outside the graph, reads f's inputs
            deps |= set(ops[f].inputs)
            flops += ops[f].flops
        grad[f] = new_id()
        if update is None:
            nodes.append(Node(grad[f], f"grad:{ops[f].name}", "backward", size(f), tuple(sorted(deps)), flops * batch,
                              f"{ops[f].op}_grad"))
            continue
        fused = update.fused_into(f, grad, rest)
        nodes += fused.state_nodes(new_id)
        deps |= fused.deps
        nodes.append(Node(grad[f], f"grad:{ops[f].name}", "backward", size(f), tuple(sorted(deps)),
                          flops * batch + fused.flops, f"{ops[f].op}_grad",
                          updates=fused.updates, writes_bytes=fused.writes))
        nodes += update.ready_nodes(grad, new_id)
    meta = {**meta, "trainable": trainable if isinstance(trainable, str) or trainable is None else list(trainable),
            "param_count": sum(o.params for o in ops),
            "trainable_param_count": sum(ops[i].params for i in train)}
    if update is not None:
        meta.update(weights="streamed", optimizer=update.optimizer, optimizer_state_bytes=update.state_bytes,
                    tiles=tiles)
    return TrainingGraph.build(name, nodes, meta=meta)


def _tiled_graph(name, ops, batch, bpe, trainable, train, meta, streamed, optimizer, *, rows) -> TrainingGraph:
    """The row-tiled graph of a transformer (model/rows.py): it cuts the weights itself."""
    from poet_opt.model.row_fit import fit_rows
    from poet_opt.model.rows import row_graph

    if not streamed or (optimizer or "none") not in ("none", "sgd"):
        raise PoetError("row tiling needs streamed weights and plain SGD", field="--strips")
    needs_grad: list[bool] = []
    for i, o in enumerate(ops):
        needs_grad.append(i in train or any(needs_grad[j] for j in o.inputs))
    meta = {**meta, "trainable": trainable if isinstance(trainable, str) or trainable is None else list(trainable),
            "param_count": sum(o.params for o in ops), "trainable_param_count": sum(ops[i].params for i in train),
            "weights": "streamed", "optimizer": "sgd", "optimizer_state_bytes": 0, "tiles": {}}
    # a torch module's own attention scaling, and its tables indexed by position (model/torch_rows.py)
    divisors, positions = rows.get("divisors"), rows.get("positions")
    if "budget" in rows:  # the tiling with the fewest nodes whose every node fits the budget
        trained = {ops[i].name for i in train}

        def build(some, tiling):
            mine = {i for i, o in enumerate(some) if o.name in trained}
            need: list[bool] = []
            for i, o in enumerate(some):
                need.append(i in mine or any(need[j] for j in o.inputs))
            return row_graph(name, some, batch, bpe, mine, need, meta, tiling, divisors=divisors,
                             positions=positions)

        chosen = fit_rows(build, ops, int(rows["budget"]), bpe, blocks=rows.get("blocks"))
        if chosen is None:
            return None
        rows = chosen
    return row_graph(name, ops, batch, bpe, train, needs_grad, meta, rows, divisors=divisors, positions=positions)


class _Fused:
    """What folding some layers' updates into one node adds to it."""

    def __init__(self):
        self.deps: set[int] = set()
        self.flops = 0.0
        self.updates: tuple[int, ...] = ()
        self.writes = 0
        self._state: list[tuple[str, int, bool]] = []

    def state_nodes(self, new_id) -> list[Node]:
        out = []
        for name, nbytes, _ in self._state:
            sid = new_id()
            out.append(Node(sid, f"state:{name}", "backward", nbytes, (), 0.0, "param"))
            self.deps.add(sid)
            self.updates += (sid,)
        return out


class _Updates:
    """Where each trained layer's update runs when weights are streamed: inside the one gradient
    node that back-propagates through the layer into its input (the last reader of the old
    weights), or, when no node or several do, in an ``update:f`` node of its own after them."""

    def __init__(self, ops, train, needs_grad, param, bpe, batch, optimizer):
        from poet_opt.model.optimizer import FLOPS_PER_WEIGHT, STATE_COPIES, optimizer_key

        key = optimizer_key(optimizer or "none")
        self.optimizer = "sgd" if key == "none" else key  # streamed weights are updated as they go
        self.flops_per_weight, self.copies = FLOPS_PER_WEIGHT[self.optimizer], STATE_COPIES[self.optimizer]
        self.ops, self.param, self.bpe, self.batch = ops, param, bpe, batch
        self.host: dict[int, list[int]] = {}  # gradient of x -> layers whose update it runs
        self.pending: list[tuple[int, set[int]]] = []  # layer -> gradients that must exist before its update
        self.state_bytes = 0
        for f in sorted(train):
            readers = sorted({x for x in ops[f].inputs if needs_grad[x]})
            if len(readers) == 1:
                self.host.setdefault(readers[0], []).append(f)
            else:
                self.pending.append((f, {f, *readers}))
            self.state_bytes += self.copies * ops[f].params * bpe

    def _fold(self, fused: _Fused, f: int, grad: dict[int, int]) -> None:
        o = self.ops[f]
        fused.deps |= {*o.inputs, grad[f], self.param[f]}  # dW = f(dL/df, f's inputs); W -= ...
        fused.flops += o.flops * self.batch + self.flops_per_weight * o.params
        fused.updates += (self.param[f],)
        fused.writes += o.params * self.bpe * (1 + self.copies)
        if self.copies:
            fused._state.append((o.name, self.copies * o.params * self.bpe, True))

    def fused_into(self, x: int, grad: dict[int, int], through) -> _Fused:
        """The updates of those layers in ``through`` whose data gradient into x is their last use."""
        fused = _Fused()
        for f in self.host.get(x, ()):
            if f in through:
                self._fold(fused, f, grad)
        return fused

    def ready_nodes(self, grad: dict[int, int], new_id) -> list[Node]:
        """``update:f`` nodes whose gradients now all exist."""
        out = []
        for f, needed in list(self.pending):
            if needed <= grad.keys():
                self.pending.remove((f, needed))
                fused = _Fused()
                self._fold(fused, f, grad)
                fused.deps |= {grad[x] for x in needed}
                out += fused.state_nodes(new_id)
                out.append(Node(new_id(), f"update:{self.ops[f].name}", "backward", 0, tuple(sorted(fused.deps)),
                                fused.flops, f"{self.optimizer}_update", updates=fused.updates,
                                writes_bytes=fused.writes))
        return out


# The importers (torch_import, onnx_import) describe a network as these forward operators and get
# its loss and backward graph from the same function, so the backward rules stay in one place.
ForwardOp = _Op
training_graph = _training_graph

