"""The support matrix (issue 27, item 5): every operator of the registry, in every tiling, through
every backend, either equals PyTorch or is refused before solving with one PoetError naming it.

What each backend is expected to do is poet_opt/model/ops/support.py (and docs/operators.md, its
generated table); this module runs every cell and checks it. Probes are tiny: one small module per
operator for the graph, the validator, the C header and the PyTorch executor (in process, cheap),
and for the firmware one emulated run per tiling of a chain holding every operator the firmware is
said to run there, after a refusal check per operator (lowering only, no build). The graph-only
backends (graph and costs, validator, C header) run each graph once. ``input`` and ``param`` are
part of every probe (the batch; streamed weights) and have no probe of their own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.model import ops  # noqa: E402
from poet_opt.model.network import lower_network  # noqa: E402
from poet_opt.model.ops import support  # noqa: E402

STRUCTURAL = set(support.STRUCTURAL)
LR = 0.05


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- one probe per operator ------------------------------------------------------------------------

class Probe(nn.Module):
    """conv (or linear) -> the operator -> conv (or linear) -> pooling -> linear head: the operator
    sits between two layers with weights, so its backward is on the path of every gradient."""

    def __init__(self, body, kind="cnn", channels=4, positive=False):
        super().__init__()
        self.kind, self.body, self.positive = kind, body, positive
        if kind == "cnn":
            self.pre, self.post = nn.Conv2d(3, channels, 3, padding=1), nn.Conv2d(channels, 4, 3, padding=1)
            # the module, not F.adaptive_avg_pool2d: strips of the functional one hit the IndexError
            # of issue 27 (model/strips.py, the lead's item 2)
            self.head, self.pool = nn.Linear(4, 3), nn.AdaptiveAvgPool2d(1)
        else:  # "mlp": (N, 6) -> linear -> op -> linear -> head, "seq": (N, 6, 6) tokens
            self.pre, self.post = nn.Linear(6, 6), nn.Linear(6, 6)
            self.head = nn.Linear(36 if kind == "seq" else 6, 3)
        if positive:  # log, sqrt, reciprocal, div: an input that stays positive through one step
            with torch.no_grad():
                self.pre.weight.abs_()
                self.pre.bias.fill_(0.5)

    def forward(self, x):
        y = self.post(self.body(self.pre(x)))
        if self.kind == "cnn":
            y = self.pool(y)
        return self.head(torch.flatten(y, 1))


class Two(nn.Module):
    """A binary operator of two branches of one input."""

    def __init__(self, fn, kind="cnn", positive=False):
        super().__init__()
        self.fn = fn
        self.b = nn.Conv2d(4, 4, 1) if kind == "cnn" else nn.Linear(6, 6)
        if positive:  # a divisor away from zero
            with torch.no_grad():
                self.b.weight.abs_()
                self.b.bias.fill_(1.0)

    def forward(self, x):
        return self.fn(x, self.b(x))


class Method(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _unary(spec):
    if spec.torch_modules:
        return getattr(nn, spec.torch_modules[0])()
    fn = spec.torch_functions[0]
    if fn == "pow":
        return Method(lambda x: x.pow(2))
    return Method(getattr(torch, fn))


def probe(name: str):
    """(module, input shape, dtype) that exercises ``name``, or None (no PyTorch spelling)."""
    spec = ops.spec(name)
    torch.manual_seed(7)
    cnn, mlp = (2, 3, 8, 8), (2, 6)
    if name == "global_avgpool":
        return Probe(nn.Identity()), cnn  # Probe pools to 1 x 1
    if name == "clip":  # torch.clamp with bounds the activations cross
        return Probe(Method(lambda x: torch.clamp(x, -0.2, 0.3))), cnn
    if name == "copy":  # a reshape PyTorch must copy: of a transposed tensor
        return Probe(Method(lambda x: x.transpose(1, 2).reshape(2, 36).reshape(2, 6, 6)), "seq"), (2, 6, 6)
    if spec.family == "activations" and spec.arity == 1:
        return Probe(_unary(spec), positive=name in ("log", "sqrt", "reciprocal")), cnn
    if name in ("add", "sub", "mul", "div"):
        fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[name]
        return Probe(Two(fn, positive=name == "div"), positive=name == "div"), cnn
    if name == "concat":
        return Probe(nn.Sequential(Two(lambda a, b: torch.cat([a, b], 1)), nn.Conv2d(8, 4, 1))), cnn
    if name in ("conv2d", "maxpool", "avgpool", "batchnorm", "groupnorm", "instancenorm"):
        body = {"conv2d": nn.Conv2d(4, 4, 3, padding=1), "maxpool": nn.MaxPool2d(2),
                "avgpool": nn.AvgPool2d(2), "batchnorm": nn.BatchNorm2d(4), "groupnorm": nn.GroupNorm(2, 4),
                "instancenorm": nn.InstanceNorm2d(4, affine=True)}[name]
        return Probe(body), cnn
    if name in ("conv1d", "conv3d"):
        d = 1 if name == "conv1d" else 3
        conv = (nn.Conv1d if d == 1 else nn.Conv3d)(3, 4, 3)
        return nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(3)), (2, 3) + (5,) * d
    if name in ("linear", "layernorm", "softmax", "log_softmax"):
        body = {"linear": nn.Linear(6, 6), "layernorm": nn.LayerNorm(6), "softmax": nn.Softmax(-1),
                "log_softmax": nn.LogSoftmax(-1)}[name]
        return Probe(body, "mlp"), mlp
    if name == "matmul":
        return Probe(Two(torch.matmul, "mlp"), "seq"), (2, 6, 6)
    if name == "attention":
        return Probe(Method(lambda x: F.scaled_dot_product_attention(x, x, x)), "seq"), (2, 6, 6)
    if name == "embedding":
        return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(20, 3)), (2, 5)
    raise AssertionError(f"no probe for {name}: add one when adding an operator")


def _materialise(module, shape):
    if isinstance(module, nn.Sequential) and isinstance(module[0], nn.Embedding):
        x = torch.randint(0, 10, shape)
    else:  # log, sqrt, reciprocal, div: a positive input through positive weights stays positive
        x = torch.rand(shape) if getattr(module, "positive", False) else torch.rand(shape) * 2 - 1
    module(x)  # LazyLinear takes its size
    return x


def _batch(module, shape, seed=3):
    torch.manual_seed(seed)
    x = _materialise(module, shape)
    y = torch.randint(0, 3, (shape[0],))
    return x, y


def _refusal(exc: PoetError, name: str, spec, also=()) -> None:
    """A refusal names the operator: its graph name, a PyTorch spelling or the node (whose name is
    the module's, which the probe makes from its class), or the option that asked for the tiling."""
    words = {name, *spec.torch_modules, *spec.torch_functions, *also, *(("reshape",) if name == "copy" else ())}
    assert any(w in str(exc) for w in words), f"{name}: the refusal does not name it: {exc}"


# -- graph, validator, C header ---------------------------------------------------------------------

def _graph_backends(graph, name: str):
    from poet_opt.firmware.header import export
    from poet_opt.schedule.validator import validate
    from poet_opt.solver.driver import solve

    schedule = solve(graph, "rpi4", ram=10 ** 12, mode="none", order="given")
    doc = schedule.to_dict()
    verdict = validate(doc)
    assert verdict["valid"] if isinstance(verdict, dict) and "valid" in verdict else verdict, verdict
    text, _, _ = export(doc)
    assert f"{len(graph.nodes)}" in text


def _check_costs(graph, name: str, spec) -> None:
    nodes = [n for n in graph.nodes if n.kind == "forward" and n.op == name]
    assert nodes, f"{name}: not in the graph"
    by_id = {n.id: n for n in graph.nodes}
    for n in nodes:
        if spec.flops_per_element is not None:
            assert n.flops == pytest.approx(spec.flops(n.bytes // 4)), name
        grads = [g for g in graph.nodes if g.name == f"grad:{by_id[n.deps[0]].name}"] if n.deps else []
        for g in grads:  # what the backward reads, as the registry says
            if "out" in spec.saves:
                assert n.id in g.deps, name
            if spec.saves == "in":
                assert n.deps[0] in g.deps, name


NAMES = [s.name for s in ops.specs() if s.name not in STRUCTURAL]


@pytest.mark.parametrize("name", NAMES)
def test_whole(name, tmp_path):
    spec = ops.spec(name)
    made = probe(name)
    if name == "clip":  # ONNX's Clip too: graph and costs from the ONNX importer
        _onnx_only(name, spec, tmp_path)
    module, shape = made
    x, y = _batch(module, shape)
    from poet_opt.model.torch_import import import_torch

    graph = import_torch(module, shape)
    if name == "global_avgpool":  # the importer's avgpool, lowered to global pooling for the kernels
        assert lower_network(module, shape, views=True).layers["head"].operands
    else:
        _check_costs(graph, name, spec)
    _graph_backends(graph, name)
    # the executor: one SGD step equals torch's, or a refusal before solving
    try:
        from poet_opt.executor.train import prepare

        network = prepare(module, shape)
    except PoetError as exc:
        assert not support.runs(spec, "whole", "executor"), f"{name}: the executor refuses it: {exc}"
        _refusal(exc, name, spec)
    else:
        assert support.runs(spec, "whole", "executor"), f"{name}: the executor runs it; support.py says not"
        _executor_step(module, network, x, y, name)
    # the firmware: lowering refuses it, or the chain run below covers it
    try:
        lower_network(module, shape)
    except PoetError as exc:
        assert not support.runs(spec, "whole", "firmware"), f"{name}: the firmware refuses it: {exc}"
        _refusal(exc, name, spec)
    else:
        assert support.runs(spec, "whole", "firmware"), f"{name}: the firmware lowers it; support.py says not"
        assert name in CHAIN_OPS["whole"], f"{name}: the firmware runs it but no chain checks it"


def _executor_step(module, network, x, y, name):
    import copy

    from poet_opt.executor.runner import ScheduleExecutor
    from poet_opt.solver.driver import solve

    reference = copy.deepcopy(module)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    schedule = solve(network.graph, "rpi4", ram=10 ** 12, mode="none")
    with ScheduleExecutor(network, schedule, lr=LR, device="cpu") as step:
        step(x, y)
    reference.train()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    F.cross_entropy(reference(x), y).backward()
    opt.step()
    first = next(n for n, _ in reference.named_parameters())  # the layer before the operator
    assert float((dict(reference.named_parameters())[first].detach() - before[first]).abs().max()) > 1e-7, \
        f"{name}: no gradient reached the layer before it; the comparison would prove nothing"
    for n, p in reference.named_parameters():
        mine = dict(module.named_parameters())[n]
        change = (p.detach() - before[n]).abs().max()
        assert torch.allclose(mine.detach(), p.detach(), rtol=0, atol=1e-6 * max(1.0, float(p.detach().abs().max()))), \
            (name, n, float((mine - p).abs().max()), float(change))


def _onnx_only(name, spec, tmp_path):
    from poet_opt.model.onnx_import import import_onnx

    class Clip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.b(torch.clamp(self.a(x), -1.0, 2.0))

    path = tmp_path / "clip.onnx"
    torch.onnx.export(Clip(), (torch.zeros(2, 6),), str(path), dynamo=False)
    graph = import_onnx(path)
    _check_costs(graph, name, spec)
    _graph_backends(graph, name)
    assert not support.runs(spec, "whole", "firmware")


# -- the firmware: one emulated run per tiling -------------------------------------------------------

class Chain(nn.Module):
    """Every operator the firmware runs on (C, H, W) tensors, in one network: conv, batch norm, the
    activations with C kernels, a residual add, max and average pooling, global pooling, a linear
    head (and, with weight slices, conv and linear layers cut into slices)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.acts = nn.Sequential(nn.ReLU(), nn.ReLU6(), nn.GELU(), nn.SiLU(), nn.Hardswish(), nn.Tanh())
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.pool1, self.pool2 = nn.MaxPool2d(2), nn.AvgPool2d(2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = self.acts(self.bn1(self.conv1(x)))
        x = self.pool1(x + self.conv2(x))
        return self.fc(torch.flatten(self.pool(self.pool2(x)), 1))


class SeqChain(nn.Module):
    """The firmware's token operators: linear, layer norm, a product of two activations, softmax."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.ln = nn.Linear(6, 6), nn.Linear(6, 6), nn.LayerNorm(6)
        self.sm, self.head = nn.Softmax(-1), nn.Linear(36, 3)

    def forward(self, x):
        x = self.ln(x)
        return self.head(torch.flatten(self.sm(torch.matmul(self.q(x), self.k(x))), 1))


def _row_chain():
    """The hand-written encoder block (examples/torch_models.py), tiny, its FFN activation every
    elementwise operator with C kernels in turn: the firmware's row operators, all in one block."""
    from poet_opt.examples.torch_models import EncoderClassifier

    torch.manual_seed(13)
    module = EncoderClassifier(d=16, h=2, ff=32, classes=3)
    module.act = nn.Sequential(nn.GELU(), nn.ReLU(), nn.ReLU6(), nn.SiLU(), nn.Hardswish(), nn.Tanh())
    return module


def _token_chain():
    """The firmware's embedding, whole: a table of 10 words, flattened into a linear head."""
    torch.manual_seed(14)
    return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(20, 3))


def _token_row_chain():
    """The encoder block on token ids (a table of 20 words before it), in row tiles."""
    from poet_opt.examples.torch_models import TokenClassifier

    torch.manual_seed(15)
    return TokenClassifier(vocab=20, d=16, h=2, ff=32, classes=3)


CHAIN_OPS = {"whole": {"add", "relu", "relu6", "gelu", "silu", "hardswish", "tanh", "conv2d", "maxpool", "avgpool",
                       "global_avgpool", "batchnorm", "linear", "layernorm", "matmul", "softmax", "embedding"},
             "strips": {"add", "relu", "relu6", "gelu", "silu", "hardswish", "tanh", "conv2d", "maxpool", "avgpool",
                        "global_avgpool", "batchnorm", "concat"},
             "rows": {"add", "relu", "relu6", "gelu", "silu", "hardswish", "tanh", "linear", "layernorm", "matmul",
                      "softmax", "avgpool", "embedding"},
             "slices": {"conv2d", "linear", "concat", "embedding"}}


def worst_against_sgd(factory, data, weights) -> tuple[float, float]:
    """(the largest weight, the largest difference from it) after one torch.optim.SGD step of a
    fresh ``factory()`` on the batch in ``data``, against ``weights`` by PyTorch's names."""
    module = factory()
    with np.load(data) as d:
        x, yy = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    F.cross_entropy(module(x), yy).backward()
    opt.step()
    reference = {n: p.detach().numpy() for n, p in module.named_parameters()}
    assert set(weights) == set(reference)
    largest = max(float(np.abs(w).max()) for w in reference.values())
    return largest, max(float(np.abs(weights[n] - w).max()) for n, w in reference.items())


def emulate_rows(factory, data, *, tile_budget: int, blocks: int = 2, program: bool | str = "auto"):
    """One step of ``factory()`` in the firmware, its row tiles fit to ``tile_budget`` bytes (small
    enough to cut the features into pieces) and planned at 200 KiB: with RAM to spare the arena
    needs no long placement search, which a plan as tight as its tiles takes a minute over."""
    pytest.importorskip("unicorn")
    pytest.importorskip("ziglang")
    from poet_opt.device.profiles import load_profile
    from poet_opt.firmware.fit import solve_for_export
    from poet_opt.firmware.row_codegen import check_rows
    from poet_opt.firmware.trainer import run_schedule

    with np.load(data) as d:
        x, y = d["x"], d["y"]
    network = lower_network(factory(), x.shape, weights="streamed", strips=blocks, strip_budget=tile_budget)
    check_rows(network)
    profile = load_profile("nrf52840")
    plan = solve_for_export(network.graph, profile, ram=200 * 1024, time_limit=5)
    return run_schedule(network, plan, profile, steps=1, lr=LR, x=x, y=y, program=program)


def _emulate(factory, shape, tmp_path, ids=None, **kw):
    """One emulated step of ``factory()`` on a random batch (``ids``: of token ids below it) against
    torch.optim.SGD's; the operators the firmware ran."""
    pytest.importorskip("unicorn")
    pytest.importorskip("ziglang")
    from poet_opt.firmware.trainer import emulate_training

    rng = np.random.default_rng(2)
    data = tmp_path / "batch.npz"
    x = rng.standard_normal(shape).astype(np.float32) if ids is None else rng.integers(0, ids, shape)
    np.savez(data, x=x, y=rng.integers(0, 3, shape[0]))
    if "tile_budget" in kw:
        result = emulate_rows(factory, data, tile_budget=kw.pop("tile_budget"), blocks=kw.pop("strips"))
    else:
        result = emulate_training(torch_model=factory, input_shape=",".join(map(str, shape)), device="nrf52840",
                                  ram="200KiB", steps=1, lr=LR, data=data, **kw)
    largest, worst = worst_against_sgd(factory, data, result.weights)
    assert worst <= 1e-4 * largest, worst
    rows = bool(result.network.graph.meta.get("rows"))  # --strips N tiles a transformer's tokens
    mark = {"strips": "@r" if rows else "@s", "tile_bytes": "#"}
    kw.setdefault("strips", 2 if rows else None)
    for option, text in mark.items():  # the plan really is in that tiling
        if kw.get(option) not in (None, "off"):
            assert any(text in n["name"] for n in result.schedule.to_dict()["graph"]["nodes"]), option
    return {layer.op for layer in result.network.layers.values()}


def _chain():
    torch.manual_seed(11)
    return Chain()


def _seq_chain():
    torch.manual_seed(12)
    return SeqChain()


@pytest.mark.parametrize("tiling", ["whole", "strips", "rows", "slices"])
def test_firmware_chain_equals_torch(tiling, tmp_path):
    kw = {"whole": {"weights": "resident", "strips": "off"},
          "strips": {"weights": "streamed", "strips": 2, "tile_bytes": 512},  # strips of weight slices too
          # two row blocks of 3 tokens, tiles small enough to cut the features into pieces
          "rows": {"strips": 2, "tile_budget": 3 * 1024},
          "slices": {"weights": "streamed", "tile_bytes": 256, "strips": "off"}}[tiling]
    if tiling == "rows":
        ran = _emulate(_row_chain, (2, 6, 16), tmp_path, **kw)
        (tmp_path / "ids").mkdir()  # a table of token ids before the block, cut into tiles of vocabulary rows
        ran |= _emulate(_token_row_chain, (2, 6), tmp_path / "ids", ids=20, **kw)
    else:
        ran = _emulate(_chain, (2, 3, 8, 8), tmp_path, **kw)
    if tiling == "whole":
        (tmp_path / "seq").mkdir()
        ran |= _emulate(_seq_chain, (2, 6, 6), tmp_path / "seq", **kw)
    if tiling in ("whole", "slices"):  # sliced: the table's 4 features one at a time (40 B of 160)
        (tmp_path / "ids").mkdir()
        ran |= _emulate(_token_chain, (2, 5), tmp_path / "ids", ids=10, **dict(kw, tile_bytes=64) if kw.get(
            "tile_bytes") else kw)
    claimed = {s.name for s in ops.specs() if support.runs(s, tiling, "firmware")} - STRUCTURAL
    assert CHAIN_OPS[tiling] == claimed, "every operator the firmware is said to run is in a chain"
    assert CHAIN_OPS[tiling] <= ran, CHAIN_OPS[tiling] - ran


def _run(factory, shape, tmp_path, ids=None, **kw):
    """`poet-opt run` (run_training) on the chain, one step, against torch.optim.SGD (``ids``: on
    token ids below it)."""
    from poet_opt.executor.train import run_training

    rng = np.random.default_rng(3)
    data = tmp_path / "batch.npz"
    x = rng.standard_normal(shape).astype(np.float32) if ids is None else rng.integers(0, ids, shape)
    np.savez(data, x=x, y=rng.integers(0, 3, shape[0]))
    result = run_training(torch_model=factory, input_shape=",".join(map(str, shape)), device="nrf52840",
                          ram="200KiB", steps=1, lr=LR, data=data, **kw)
    largest, worst = worst_against_sgd(factory, data, result.weights)
    assert worst <= 1e-6 * max(1.0, largest), worst
    return result.schedule


@pytest.mark.parametrize("tiling", ["strips", "slices"])
def test_executor_chain_equals_torch(tiling, tmp_path):
    """`poet-opt run` trains the firmware's chain with weight slices (and strips of them) through the
    tiled executor, equal to PyTorch: every operator support.py says the executor runs in that tiling."""
    kw = {"strips": {"weights": "streamed", "strips": 2, "weight_tile": "512B"},
          "slices": {"weights": "streamed", "weight_tile": "256B", "strips": "off"}}[tiling]
    doc = _run(_chain, (2, 3, 8, 8), tmp_path, **kw)
    doc = doc.to_dict() if hasattr(doc, "to_dict") else doc
    names = [n["name"] for n in doc["graph"]["nodes"]]
    assert any("#" in n for n in names), "the plan has weight slices"
    if tiling == "slices":  # a table cut into its features, one at a time (40 B of 160)
        (tmp_path / "ids").mkdir()
        table = _run(_token_chain, (2, 5), tmp_path / "ids", ids=10, **dict(kw, weight_tile="64B"))
        table = table.to_dict() if hasattr(table, "to_dict") else table
        assert {"param:0#0", "param:0#3"} <= {n["name"] for n in table["graph"]["nodes"]}
    assert (tiling == "strips") == any("@s" in n for n in names), "strips only where asked"
    claimed = {s.name for s in ops.specs() if support.runs(s, tiling, "executor")} - STRUCTURAL
    in_chain = CHAIN_OPS[tiling] if tiling == "slices" else CHAIN_OPS["strips"]
    assert claimed <= in_chain | {s.name for s in ops.specs() if s.split == "elementwise"}, claimed - in_chain


# -- activation strips --------------------------------------------------------------------------------

def _zoo_probe(name: str):
    """The CNN probe as the zoo's forward operators (the strip graph's input): pre conv, the
    operator (on (C, H, W) tensors, whatever it is), post conv, global pooling, linear head."""
    from poet_opt.model import zoo

    spec = ops.spec(name)
    net = zoo._Net((3, 8, 8))
    pre = net.conv(0, "pre", 4, 3, bias=True)
    if name == "add":
        body = net.add(pre, net.conv(pre, "body.b", 4, 1, bias=True), "body")
    elif name in ("conv2d", "concat"):  # concat: the join of a sliced convolution's outputs
        body = net.conv(pre, "body", 4, 3, bias=True)
    elif name == "maxpool":
        body = net.maxpool(pre, "body", 2, 2, 0)
    elif name == "avgpool":
        body = net.avgpool(pre, "body", (4, 4))
    elif name == "batchnorm":
        body = net.bn(pre, "body")
    elif name == "global_avgpool":
        body = pre  # the probe's own pooling
    else:  # any other operator on a (C, H, W) tensor: the strip builder splits it or names it
        inputs = (pre, net.conv(pre, "body.b", 4, 1, bias=True)) if spec.arity == 2 else (pre,)
        body = net._add("body", name, inputs, net.shape(pre), 1.0 * 4 * 64, saves=spec.saves)
    x = net.conv(body, "post", 4, 3, bias=True)
    net.linear(net.avgpool(x, "pool"), "head", 3)
    return net.ops


@pytest.mark.parametrize("name", NAMES)
def test_strips(name):
    from poet_opt.model import zoo

    spec = ops.spec(name)
    tile = 512 if name == "concat" else None  # body's and post's 148 weights in slices, joined by a concat
    try:
        graph = zoo.training_graph("probe", _zoo_probe(name), 2, 4, "all", {"bytes_per_element": 4},
                                    weights="streamed", strips={8: 2, 4: 2}, tile_bytes=tile)
    except PoetError as exc:
        assert not support.graph_runs(spec, "strips"), f"{name}: the strip graph refuses it: {exc}"
        _refusal(exc, name, spec, also=("--strips",))
        assert not support.runs(spec, "strips", "firmware") and not support.runs(spec, "strips", "executor")
        return
    assert support.graph_runs(spec, "strips"), f"{name}: the strip builder splits it; the registry says not"
    target = "avgpool" if name == "global_avgpool" else name
    assert any(n.op == target and ("@s" in n.name or target == "avgpool") for n in graph.nodes), name
    _graph_backends(graph, name)
    # the executor's strip replay, against autograd on the same network in PyTorch
    from poet_opt.executor.strips import replay

    if probe(name) is None:  # no PyTorch spelling: nothing to replay it against
        assert not support.runs(spec, "strips", "executor") and not support.runs(spec, "strips", "firmware")
        return
    module, shape = probe("conv2d" if name == "concat" else name)
    x, y = _batch(module, shape)
    named = dict(module.named_parameters())
    params = {}
    for layer, info in graph.meta["strips"].layers.items():
        base = layer.split("#")[0]
        roles = {role: named[f"{base}.{role}"].detach().clone() for role in ("weight", "bias")
                 if f"{base}.{role}" in named}
        if roles:
            params[layer] = roles
    for base, tiles in (graph.meta.get("tiles") or {}).items():  # a slice: its rows of the layer's tensors
        lo = 0
        for piece in tiles:
            hi = lo + graph.meta["strips"].layers[piece].shape[0]
            params[piece] = {r: v[lo:hi].clone() for r, v in params[piece].items()}
            lo = hi
    try:
        result = replay(graph, params, x, y, LR)
    except (ValueError, KeyError) as exc:
        assert not support.runs(spec, "strips", "executor"), f"{name}: the strip replay cannot run it: {exc!r}"
        return
    assert support.runs(spec, "strips", "executor"), f"{name}: the strip replay runs it; support.py says not"
    module.train()
    F.cross_entropy(module(x), y).backward()
    for layer, roles in result["weight_grads"].items():
        for role, mine in roles.items():
            ref = named[f"{layer.split('#')[0]}.{role}"].grad
            if "#" in layer:  # a slice: its rows of the gradient
                lo = sum(graph.meta["strips"].layers[t].shape[0]
                         for t in graph.meta["tiles"][layer.split("#")[0]].names[:int(layer.split("#")[1])])
                ref = ref[lo:lo + mine.shape[0]]
            assert torch.allclose(mine, ref, atol=1e-6, rtol=1e-4), (name, layer, role)
    # the firmware: lowering refuses it, or the strips chain covers it
    assert (name in CHAIN_OPS["strips"]) == support.runs(spec, "strips", "firmware")
    if probe(name) is not None and not support.runs(spec, "strips", "firmware"):
        with pytest.raises(PoetError) as refused:  # concat: strips of sliced layers
            lower_network(module, shape, weights="streamed", strips=2, tile_bytes=tile)
        _refusal(refused.value, name, spec, also=("weight tiles",) if tile else ())


# -- row tiles and weight slices: the graph builders ----------------------------------------------------

class _Call(nn.Module):
    """A registry operator by its torch function, as a user's forward would call it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _row_module(name: str, spec):
    """The hand-written encoder block of examples/torch_models.py, small, with its FFN activation
    swapped for ``name`` (after a sigmoid where its domain is positive); None when torch has no
    function of that name. Every other operator row tiles run is in the block already."""
    from poet_opt.examples.torch_models import EncoderClassifier

    torch.manual_seed(0)
    if name == "embedding":  # the block on token ids: a table of 20 words before it
        from poet_opt.examples.torch_models import TokenClassifier

        return TokenClassifier(vocab=20, d=16, h=2, ff=32, classes=3)
    module = EncoderClassifier(d=16, h=2, ff=32, classes=3)
    if spec.split == "elementwise" and spec.arity == 1:
        fn = getattr(F, name, None) or getattr(torch, name, None)
        if fn is None:
            return None
        module.act = nn.Sequential(nn.Sigmoid(), _Call(fn)) if name in ("log", "sqrt", "reciprocal") else _Call(fn)
    return module


def _row_shape(name: str) -> tuple[int, ...]:
    return (1, 8) if name == "embedding" else (1, 8, 16)  # token ids, or hidden states


def _row_run_equals_torch(name: str, module) -> None:
    """`poet-opt run`'s executor on a plan of the module's row graph (two blocks of four tokens):
    one SGD step equal to torch's within 1e-6 of the largest weight (docs/operators.md), at the plan's
    peak."""
    import copy

    from poet_opt.executor.tiled import TiledExecutor
    from poet_opt.solver.driver import solve

    shape = _row_shape(name)
    reference = copy.deepcopy(module)
    network = lower_network(module, shape, weights="streamed", strips=2, strip_budget=10 ** 9)
    # the mean over tokens is one vector, summed over the blocks in links (+b)
    assert any(n.op == name and ("@r1" in n.name or n.name.endswith("+0")) for n in network.graph.nodes), \
        f"{name}: not in row blocks"
    plan = solve(network.graph, "rpi4", ram=10 ** 12, mode="none", order="given")
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 20, shape, generator=gen) if name == "embedding" else torch.randn(shape, generator=gen)
    y = torch.tensor([1])
    with TiledExecutor(network, plan, lr=LR) as step:
        step(x, y)
        trained, peak = step.weights(), step.last.peak_live_bytes
    assert peak == step.planned_peak_bytes
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    F.cross_entropy(reference(x), y).backward()
    opt.step()
    want = {n: p.detach().numpy() for n, p in reference.named_parameters()}
    assert set(trained) == set(want)
    scale = max(float(np.abs(v).max()) for v in want.values())
    worst = max(float(np.abs(trained[n] - want[n]).max()) for n in want)
    assert worst <= 1e-6 * scale, (name, worst)


@pytest.mark.parametrize("name", NAMES)
def test_rows(name):
    """Row tiles: in the zoo's encoder block, the FFN's activation swapped for each operator, the row
    builder splits it or refuses it naming it. The firmware runs what the support table says (the
    rows chain above shows it), and refuses the rest before solving, naming the node; the PyTorch
    executor (`poet-opt run`) runs what the support table says, in a torch module's row tiles, equal
    to torch, and the torch row lowering refuses the rest naming the node."""
    from dataclasses import replace

    from poet_opt.model import zoo
    from poet_opt.model.rows import refuse_rows

    spec = ops.spec(name)
    net = zoo._Net((8,))  # token ids -> embedding -> one encoder block: every operator rows split
    zoo._encoder_block(net, net.embedding(0, "embed", 50, 32), "block", d=32, heads=2, d_ff=64)
    swap = spec.arity == 1 and spec.split == "elementwise"  # the generic piece-by-piece path
    if swap:
        net.ops = [replace(o, op=name, saves=spec.saves) if o.op == "gelu" else o for o in net.ops]
    elif name == "avgpool":  # the mean over tokens before a classifier
        net._add("pool", "avgpool", (len(net.ops) - 1,), (32,), 8 * 32)
        net.linear(len(net.ops) - 1, "classifier", 2)
    elif name not in {o.op for o in net.ops}:
        net.ops = [replace(o, op=name) if o.op == "gelu" else o for o in net.ops]
    rows = {"blocks": 2, "piece": 32, "vocab_rows": 32}
    try:
        graph = zoo.training_graph("probe", net.ops, 1, 4, "all", {}, weights="streamed", rows=rows)
    except PoetError as exc:
        assert not support.graph_runs(spec, "rows"), f"{name}: the row builder refuses it: {exc}"
        _refusal(exc, name, spec)
        return
    assert support.graph_runs(spec, "rows"), f"{name}: the row builder splits it; the registry says not"
    assert any(n.op == name and "@r" in n.name for n in graph.nodes), name
    _graph_backends(graph, name)
    with pytest.raises(PoetError, match="row"):  # a network lowered without its row tiles
        refuse_rows([{"name": n.name, "op": n.op} for n in graph.nodes], "the firmware generator", "--model")
    assert (name in CHAIN_OPS["rows"]) == support.runs(spec, "rows", "firmware")
    module = _row_module(name, spec)
    if support.runs(spec, "rows", "executor"):
        assert module is not None, f"{name}: said to run in rows, with no probe to show it"
        _row_run_equals_torch(name, module)
        if not support.runs(spec, "rows", "firmware"):  # emulate refuses it before solving, naming the node
            from poet_opt.firmware.row_codegen import check_rows

            network = lower_network(module, _row_shape(name), weights="streamed", strips=2, strip_budget=10 ** 9)
            with pytest.raises(PoetError) as refused:
                check_rows(network)
            assert refused.value.field == "--strips"
            _refusal(refused.value, name, spec)
    elif module is not None:
        with pytest.raises(PoetError) as refused:
            lower_network(module, (1, 8, 16), weights="streamed", strips=2, strip_budget=10 ** 9)
        _refusal(refused.value, name, spec)


@pytest.mark.parametrize("name", NAMES)
def test_slices(name):
    """Weight slices cut the output features of the registry's sliceable layers; every other
    operator stays whole in a sliced graph."""
    spec = ops.spec(name)
    made = probe(name)
    if made is None:
        return
    module, shape = made
    _materialise(module, shape)
    from poet_opt.model.torch_import import import_torch

    try:
        graph = import_torch(module, shape, weights="streamed", tile_bytes=64)
    except PoetError as exc:
        pytest.fail(f"{name}: slices never refuse an operator, they leave it whole: {exc}")
    sliced = {n.op for n in graph.nodes if n.kind == "forward" and "#" in n.name and n.op != "param"}
    assert sliced <= {s.name for s in ops.specs() if "slices" in s.tiled}
    if "slices" in spec.tiled and name != "concat":  # concat is what joins the slices
        assert name in sliced, f"{name}: not sliced"
        _graph_backends(graph, name)
    # the firmware and the executor (executor/tiled.py, `poet-opt run`) run the same sliced layers,
    # each checked against torch by its chain test
    assert (name in CHAIN_OPS["slices"]) == support.runs(spec, "slices", "firmware")
    assert (name in CHAIN_OPS["slices"]) == support.runs(spec, "slices", "executor")


def test_the_docs_table_is_the_registrys():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "operators.md").read_text()
    start = doc.index("<!-- generated: python -m poet_opt.model.ops -->\n") + len(
        "<!-- generated: python -m poet_opt.model.ops -->\n")
    end = doc.index("<!-- end generated -->")
    assert doc[start:end] == support.table(), "regenerate: python -m poet_opt.model.ops"


def test_every_operator_has_a_probe_or_says_why_not():
    missing = [n for n in NAMES if probe(n) is None]
    assert not missing
    assert math.isclose(len(NAMES) + len(STRUCTURAL), len(ops.specs()))


ROW_REPLAYED = [n for n in ops.names(split="elementwise", tiling="rows")
                if ops.spec(n).arity == 1 and ops.spec(n).torch_forward is not None
                and n not in ("log", "sqrt", "reciprocal")]  # their domain: the FFN's inputs go negative


@pytest.mark.parametrize("name", ROW_REPLAYED)
def test_row_replay_runs_every_elementwise_operator_as_autograd(name, monkeypatch):
    """The row replay `poet-opt run` walks (executor/rows.py) runs every elementwise operator from
    the registry in the zoo's row graphs too (embeddings, a [CLS] pooler): a toy BERT with
    its FFN activation swapped for ``name`` replays equal to autograd on the same model, whose
    activation is torch's own function of that name (not the registry's reference)."""
    from dataclasses import replace

    from test_rows import _params, _reference, _tiny_bert

    from poet_opt.executor.rows import replay
    from poet_opt.model.zoo import training_graph

    spec = ops.spec(name)
    net = _tiny_bert(layers=1)
    swapped = [replace(o, op=name, saves=spec.saves, flops=spec.flops(math.prod(o.shape))) if o.op == "gelu" else o
               for o in net.ops]
    graph = training_graph("tiny", swapped, 2, 8, "all", {}, weights="streamed",
                           rows={"blocks": 2, "piece": 8, "vocab_rows": 4})
    assert any(n.op == name and "@r" in n.name for n in graph.nodes)
    gen = torch.Generator().manual_seed(1)
    params = _params(net.ops, gen)
    ids, y = torch.randint(0, 11, (2, 8), generator=gen), torch.tensor([2, 0])
    mine = {k: {r: v.clone() for r, v in layer.items()} for k, layer in params.items()}
    for p in (p for layer in params.values() for p in layer.values()):
        p.requires_grad_(True)
    fn = getattr(F, name, None) or getattr(torch, name)
    monkeypatch.setattr(F, "gelu", fn)  # the reference's FFN activation: torch's own
    F.cross_entropy(_reference(net.ops, params, ids)[-1], y).backward()
    result = replay(graph, mine, ids, y, 0.1)
    for layer, roles in params.items():
        for role, p in roles.items():
            got = result["weight_grads"][layer][role]
            assert torch.allclose(got, p.grad, rtol=1e-9, atol=1e-12), (name, layer, role)
