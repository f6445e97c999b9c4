"""Activation strips (model/strips.py): the strip graph's maths equals the unsplit network's, and
its structure is the unstriped graph's when nothing is split."""

from __future__ import annotations

import json

import numpy as np
import pytest

from poet_opt.model.strips import partition
from poet_opt.model.tiling_records import receptive, touching
from poet_opt.model.zoo import _Net, build_model, training_graph

torch = pytest.importorskip("torch")


def _small_cnn() -> _Net:
    """Convolutions with stride 1 and 2 and padding, batch norm, ReLU, a residual add with a
    strided 1x1 shortcut, max and average pooling, global pooling and a linear head."""
    net = _Net((3, 16, 14))
    x = net.act(net.bn(net.conv(0, "conv1", 4, 3), "bn1"), "relu1")
    y = net.bn(net.conv(x, "conv2", 6, 3, 2), "bn2")
    x = net.act(net.add(y, net.conv(x, "down", 6, 1, 2), "add"), "relu2")
    x = net.maxpool(x, "pool", 3, 2, 1)
    x = net.act(net.conv(x, "conv3", 8, 3, bias=True), "relu3")
    x = net.avgpool(x, "avg", (2, 2))
    net.linear(net.avgpool(x, "gap"), "fc", 5)
    return net


def _reference(ops, params, x, y):
    """The unsplit network in torch autograd: the loss, every tensor (its .grad kept)."""
    F = torch.nn.functional
    out = []
    for o in ops:
        ins = [out[i] for i in o.inputs]
        p = params.get(o.name, {})
        if o.op == "input":
            v = x.clone().requires_grad_(True)
        elif o.op == "conv2d":
            k, s, pad = o.window
            v = F.conv2d(ins[0], p["weight"], p.get("bias"), stride=s, padding=pad, groups=_groups(o, ops))
        elif o.op == "batchnorm":
            v = F.batch_norm(ins[0], None, None, p["weight"], p["bias"], training=True, eps=1e-5)
        elif o.op == "relu":
            v = torch.relu(ins[0])
        elif o.op == "add":
            v = ins[0] + ins[1]
        elif o.op == "maxpool":
            v = F.max_pool2d(ins[0], o.window[0], o.window[1], o.window[2])
        elif o.op == "avgpool":
            v = F.avg_pool2d(ins[0], o.window[0], o.window[1]) if o.window else ins[0].mean(dim=(2, 3))
        elif o.op == "linear":
            v = F.linear(ins[0].flatten(1), p["weight"], p["bias"])
        v.retain_grad()
        out.append(v)
    loss = F.cross_entropy(out[-1], y)
    return loss, out


def _groups(o, ops) -> int:
    cin = ops[o.inputs[0]].shape[0]
    return cin if o.params in (o.shape[0] * o.window[0] ** 2, o.shape[0] * o.window[0] ** 2 + o.shape[0]) \
        and cin == o.shape[0] > 1 else 1


def _params(ops, gen):
    params = {}
    for o in ops:
        if o.op == "conv2d":
            cin = ops[o.inputs[0]].shape[0] // _groups(o, ops)
            params[o.name] = {"weight": torch.randn(o.shape[0], cin, o.window[0], o.window[0], generator=gen,
                                                    dtype=torch.float64) * 0.4}
            if o.params > o.shape[0] * cin * o.window[0] ** 2:
                params[o.name]["bias"] = torch.randn(o.shape[0], generator=gen, dtype=torch.float64)
        elif o.op == "batchnorm":
            params[o.name] = {"weight": 1 + 0.3 * torch.randn(o.shape[0], generator=gen, dtype=torch.float64),
                              "bias": 0.3 * torch.randn(o.shape[0], generator=gen, dtype=torch.float64)}
        elif o.op == "linear":
            fan_in = o.params // o.shape[0] - 1
            params[o.name] = {"weight": torch.randn(o.shape[0], fan_in, generator=gen, dtype=torch.float64) * 0.3,
                              "bias": torch.randn(o.shape[0], generator=gen, dtype=torch.float64)}
    return params


def _two_steps_as_sgd(ops, params, x, y, run_step, peak_bytes: int) -> None:
    """Two steps of torch.optim.SGD (lr 0.05) on the unsplit network from ``params``, each beside one
    ``run_step()`` of the plan: the same loss each time, within ``peak_bytes`` of RAM. ``params`` end
    as SGD leaves them, for the caller to compare with the plan's weights."""
    reference = [p.requires_grad_(True) for layer in params.values() for p in layer.values()]
    sgd = torch.optim.SGD(reference, lr=0.05)
    for _ in range(2):
        sgd.zero_grad()
        loss, _ = _reference(ops, params, x, y)
        loss.backward()
        sgd.step()
        ran = run_step()
        _close(ran["loss"], loss.detach(), "loss")
        assert ran["peak_bytes"] <= peak_bytes


def _close(a, b, what):
    scale = max(float(b.abs().max()), 1e-30)
    err = float((a - b).abs().max()) / scale
    assert err <= 1e-9, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("strips,tile", [({16: 3, 8: 3, 4: 2, 2: 2}, None), ({16: 5, 8: 2, 4: 4, 2: 2}, 4 * 3 * 9 * 8),
                                         ({16: 16, 8: 8, 4: 4, 2: 2}, None)])
def test_strip_graph_replays_autograd_and_sgd_exactly(strips, tile):
    """Every node of the strip graph run in PyTorch on its strips, reading only its deps, gives the
    unsplit network's loss, gradients of every tensor and weight (summed over strips), and one
    SGD step equal to torch.optim.SGD's; tile: conv2's weights in slices too (a concat over strips)."""
    net = _small_cnn()
    graph = training_graph("cnn", net.ops, 2, 8, "all", {}, weights="streamed", tile_bytes=tile, strips=strips)
    assert any("@s" in n.name for n in graph.nodes) and any(n.op == "batchnorm_stats" for n in graph.nodes)
    assert {n.name for n in graph.nodes} >= {"conv2#0@s1", "stats:bn1@s2", "gstats:bn2@s1", "wgrad:conv1@s0"} \
        if tile else {"conv2@s1", "stats:bn1@s2", "gstats:bn2@s1", "wgrad:conv1@s0"}
    _assert_replay_is_autograd(net, graph)


def _assert_replay_is_autograd(net, graph):
    """The strip graph, node by node in its order, against autograd and SGD on the unsplit ``net``."""
    from poet_opt.executor.strips import replay

    gen = torch.Generator().manual_seed(0)
    params = _params(net.ops, gen)
    x = torch.randn(2, 3, 16, 14, generator=gen, dtype=torch.float64)
    y = torch.tensor([1, 3])
    lr = 0.1

    loss, tensors = _reference(net.ops, params, x, y)
    reference = [p for layer in params.values() for p in layer.values()]
    for p in reference:
        p.requires_grad_(True)
    loss, tensors = _reference(net.ops, params, x, y)
    loss.backward()

    tiles = graph.meta["tiles"]
    mine = _sliced(net, graph, params)
    result = replay(graph, mine, x, y, lr)

    _close(result["loss"], loss.detach(), "loss")
    parts = graph.meta["strips"].tensors
    values = result["values"]
    checked = 0
    for o, t in zip(net.ops, tensors):
        if o.op == "input":
            continue
        if o.name in parts:
            got = torch.cat([values[f"grad:{o.name}@s{j}"] for j in range(len(parts[o.name]))], dim=2)
            value = torch.cat([values[f"{o.name}@s{j}"] for j in range(len(parts[o.name]))], dim=2)
        else:
            got, value = values[f"grad:{o.name}"], values[o.name]
        _close(value, t.detach(), f"{o.name}")
        _close(got, t.grad, f"grad:{o.name}")
        checked += 1
    assert checked == len(net.ops) - 1  # every tensor but the input, which needs no gradient
    for name, layer in params.items():
        pieces = tiles.get(name, [name])
        for role, p in layer.items():
            grad = torch.cat([result["weight_grads"][piece][role] for piece in pieces])
            _close(grad, p.grad, f"weight gradient of {name}.{role}")
    sgd = torch.optim.SGD(reference, lr=lr)
    sgd.step()
    for name, layer in params.items():
        pieces = tiles.get(name, [name])
        for role, p in layer.items():
            _close(torch.cat([mine[piece][role] for piece in pieces]), p.detach(), f"{name}.{role} after SGD")


def _sliced(net, graph, params) -> dict:
    """Copies of ``params`` cut as the graph slices each layer's weights (output channels)."""
    tiles, mine = graph.meta["tiles"], {}
    for o in net.ops:
        if o.name not in params:
            continue
        if o.name in tiles:
            lo = 0
            for name in tiles[o.name]:
                hi = lo + graph.meta["strips"].layers[name].shape[0]
                mine[name] = {r: v.detach()[lo:hi].clone() for r, v in params[o.name].items()}
                lo = hi
        else:
            mine[o.name] = {r: v.detach().clone() for r, v in params[o.name].items()}
    return mine


def _one_channel_slices():
    """The small CNN with every tensor in strips and conv2's weights in slices of one output
    channel (288 B), as the strip builder emits it; the linear head's 360 B stay whole (the replay
    has no kernel for a head in slices)."""
    net = _small_cnn()
    return net, training_graph("cnn", net.ops, 2, 8, "all", {}, weights="streamed", tile_bytes=360,
                               strips={16: 5, 8: 3, 4: 2, 2: 2})


def _runs_per_slice(graph, tensor: str) -> dict[int, int]:
    """For the data gradient of ``tensor`` through sliced layers (``grad:x@sj+k``, partial sum k
    of strip j): in how many separate runs of the execution order each k is used."""
    import re

    pattern = re.compile(rf"grad:{re.escape(tensor)}@s\d+\+(\d+)$")
    sequence = [int(m.group(1)) for n in graph.nodes if (m := pattern.match(n.name))]
    runs: dict[int, int] = {}
    for at, k in enumerate(sequence):
        if at == 0 or sequence[at - 1] != k:
            runs[k] = runs.get(k, 0) + 1
    return runs


@pytest.mark.parametrize("budget,runs", [(20_000, 2), (40_000, 1)])
def test_slice_blocks_order_replays_autograd_exactly(budget, runs):
    """Given the RAM budget, the strip order runs each weight slice over a block of strips before
    the next slice (model/strip_order.py): relu1's gradient through conv2's six slices in two
    blocks of its five strips at 20 kB, in one at 40 kB, where the greedy order reads each slice
    again for almost every strip. Replayed in that order, the graph still equals autograd and SGD exactly."""
    from poet_opt.model.orders import is_topological
    from poet_opt.model.strips import low_memory

    net, builder = _one_channel_slices()
    greedy, graph = low_memory(builder), low_memory(builder, budget)
    assert min(_runs_per_slice(greedy, "relu1").values()) >= 4  # of the five strips, two at most run together
    assert _runs_per_slice(graph, "relu1") == {k: runs for k in range(6)}  # conv2's six one-channel slices
    by_name = {n.name: n.id for n in builder.nodes}
    assert is_topological(builder, [by_name[n.name] for n in graph.nodes])
    _assert_replay_is_autograd(net, graph)


def test_a_slice_blocks_plan_validates_and_trains_as_pytorch_sgd():
    """The solver's plan of the slice-block order at 20 kB (relu1's gradient in two blocks of strips;
    the largest node holds 14 kB) passes the validator, and executed step by step, its page-ins,
    re-reads and frees included, it trains two SGD steps as torch autograd and torch.optim.SGD do."""
    from poet_opt.executor.strips import run_plan
    from poet_opt.model.strips import low_memory
    from poet_opt.schedule.validator import validate
    from poet_opt.solver.driver import solve

    net, builder = _one_channel_slices()
    schedule = solve(low_memory(builder, 20_000), "nrf52840", ram=20_000, time_limit=10, order="given")
    doc = schedule.to_dict()
    validate(doc)
    assert doc["totals"]["peak_ram_bytes"] <= 20_000 < builder.plain_peak_bytes()
    names = [n.name for n in schedule.graph.nodes]
    steps = [(s["op"], names[s["node"]]) for s in doc["steps"]]
    assert any(op == "page_in" for op, _ in steps) and any(op == "compute" and "+" in n for op, n in steps)
    gen = torch.Generator().manual_seed(5)
    params = _params(net.ops, gen)
    mine = _sliced(net, builder, params)
    x = torch.randn(2, 3, 16, 14, generator=gen, dtype=torch.float64)
    y = torch.tensor([1, 3])
    _two_steps_as_sgd(net.ops, params, x, y, lambda: run_plan(schedule.graph, steps, mine, x, y, 0.05), 20_000)
    for name, layer in params.items():
        pieces = builder.meta["tiles"].get(name, [name])
        for role, p in layer.items():
            _close(torch.cat([mine[piece][role] for piece in pieces]), p.detach(), f"{name}.{role} after two steps")


@pytest.mark.parametrize("model,kw", [("resnet18-cifar", {"tile_bytes": 50 * 1024}), ("mcu-vww", {}),
                                      ("mobilenetv2", {}), ("vgg16-cifar", {"tile_bytes": 100_000})])
def test_one_strip_is_the_unstriped_graph(model, kw):
    """strips=1 builds exactly the graph the streamed-weights builder builds: names, sizes,
    FLOPs, dependencies, updates."""
    plain = build_model(model, weights="streamed", **kw)
    striped = build_model(model, weights="streamed", strips=1, **kw)

    def shape(g):
        return [(n.name, n.kind, n.bytes, round(n.flops, 3), n.op, tuple(sorted(g.nodes[d].name for d in n.deps)),
                 tuple(g.nodes[p].name for p in n.updates), n.writes_bytes) for n in g.nodes]

    assert shape(plain) == shape(striped)


def test_windows_cover_the_receptive_rows():
    assert partition(32, 3) == [(0, 11), (11, 21), (21, 32)]
    assert receptive((0, 4), (3, 1, 1), 32) == (0, 5) and receptive((4, 8), (3, 2, 1), 32) == (7, 16)
    assert touching((7, 16), (3, 2, 1), 16) == (3, 9) and touching((1, 2), (1, 2, 0), 16) == (1, 1)


@pytest.fixture(scope="module")
def vww_strip_plan(tmp_path_factory):
    """mcu-vww in four strips per tensor at 64 KiB: without strips one node needs 108 KiB."""
    from test_cli import cli

    out = tmp_path_factory.mktemp("strips") / "vww.json"
    result = cli("solve", "--model", "mcu-vww", "--device", "nrf52840", "--ram", "64KiB", "--weights", "streamed",
                 "--strips", "4", "--time-limit", "4", "-q", "--json", "--out", out, "--export", out.with_suffix(".h"))
    assert result.exit_code == 0, result.stderr
    return json.loads(out.read_text()), json.loads(result.stdout), out.with_suffix(".h").read_text()


def test_strips_option_plans_below_the_unsplit_working_set(vww_strip_plan):
    from poet_opt.schedule.validator import validate

    doc, summary, _ = vww_strip_plan
    validate(doc)
    names = {n["name"] for n in doc["graph"]["nodes"]}
    assert {"conv0@s0", "stats:bn0@s3", "gstats:bn0@s3", "wgrad:conv0@s3", "grad:relu0@s2"} <= names
    assert doc["totals"]["peak_ram_bytes"] <= 64 * 1024 and doc["memory"]["fits_device"]
    assert build_model("mcu-vww", weights="streamed").min_working_set_bytes() > 64 * 1024


def test_header_exports_a_strip_plan(vww_strip_plan):
    doc, _, header = vww_strip_plan
    assert "stats:bn0@s3" in header and "wgrad:conv0@s3" in header
    assert header.count("{") > len(doc["steps"])  # a row per step


def test_executors_refuse_a_strip_plan_in_one_line(vww_strip_plan, tmp_path):
    """The PyTorch executor and the firmware generator run strips only for a network lowered with
    its strips: they say so, naming a strip node, rather than mis-run the plan
    (tests/test_firmware_strips.py trains a strip plan in firmware, tests/test_run_tiles.py in
    PyTorch; a layer its strip replay has no kernel for is refused there, naming it)."""
    from poet_opt.errors import PoetError
    from poet_opt.executor.runner import check_schedule
    from poet_opt.firmware import codegen
    from poet_opt.model.zoo_twins import zoo_module
    from poet_opt.model.network import lower_network

    doc, _, _ = vww_strip_plan
    network = lower_network(zoo_module("mcu-vww"), (1, 1, 96, 96), weights="streamed")
    with pytest.raises(PoetError, match=r"splits activations into strips \(node .*@s\d.*PyTorch executor"):
        check_schedule(network, doc)
    with pytest.raises(PoetError, match=r"splits activations into strips .*firmware generator for a network lowered "
                                        "without strips"):
        codegen.generate(network, doc, None, None, steps=1, lr=0.1, x=None, y=None)


def test_the_strip_plan_trains_as_pytorch_sgd(vww_strip_plan):
    """The PyTorch execution of the solved plan itself (its recomputes, page-outs, page-ins and
    frees, each compute on resident tensors only) trains mcu-vww in strips for two SGD steps with
    the loss and weights of torch autograd and torch.optim.SGD on the unsplit network (float64)."""
    from poet_opt.cli import load_graph
    from poet_opt.device.profiles import load_profile
    from poet_opt.executor.strips import run_plan
    from poet_opt.model.zoo import _ZOO

    doc, _, _ = vww_strip_plan
    graph, _ = load_graph("mcu-vww", None, batch_size=1, bytes_per_element=4, weights="streamed",
                          profile=load_profile("nrf52840"), ram=["64KiB"], strips="4")
    names = [n["name"] for n in doc["graph"]["nodes"]]
    assert sorted(names) == sorted(n.name for n in graph.nodes)
    steps = [(s["op"], names[s["node"]]) for s in doc["steps"]]
    assert any(op == "page_in" for op, _ in steps) and any(op == "compute" and "@s" in n for op, n in steps)

    net = _Net((1, 96, 96))
    _ZOO["mcu-vww"][3](net)
    gen = torch.Generator().manual_seed(3)
    params = _params(net.ops, gen)
    mine = {name: {r: v.clone() for r, v in layer.items()} for name, layer in params.items()}
    x = torch.randn(1, 1, 96, 96, generator=gen, dtype=torch.float64)
    y = torch.tensor([1])
    _two_steps_as_sgd(net.ops, params, x, y, lambda: run_plan(graph, steps, mine, x, y, 0.05), 64 * 1024)
    for name, layer in params.items():
        for role, p in layer.items():
            _close(mine[name][role], p.detach(), f"{name}.{role} after two steps")


def test_solve_splits_a_torch_cnn_into_the_strips_emulate_trains(tmp_path):
    """`poet-opt solve --torch` on a CNN whose stem output alone (288 KiB) exceeds the nRF52840:
    the graph it plans is the strip graph `poet-opt emulate` lowers and trains, node for node, and
    its plan fits the board. With --strips off it is refused, naming the node that cannot fit."""
    from click.testing import CliRunner

    from poet_opt.cli import load_graph, main
    from poet_opt.device.profiles import load_profile
    from poet_opt.model.network import lower_network

    spec, profile = "poet_opt.examples.torch_models:strip_cnn", load_profile("nrf52840")
    graph, _ = load_graph(None, None, torch=spec, input_shape="1,1,96,96", batch_size=1, bytes_per_element=4,
                          weights="auto", profile=profile, ram=["160KiB"])
    budget = 160 * 1024
    lowered = lower_network(spec, (1, 1, 96, 96), weights="streamed", strips="auto", strip_budget=budget).graph
    assert [n.name for n in graph.nodes] == [n.name for n in lowered.nodes]
    assert any("@s" in n.name for n in graph.nodes) and graph.largest_working_set()[0] <= budget
    args = ["solve", "--torch", spec, "--input-shape", "1,1,96,96", "--device", "nrf52840", "--ram", "160KiB",
            "--time-limit", "10", "-q", "--json"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    memory = json.loads(run.stdout)["memory"]
    assert memory["fits_device"] and memory["total_bytes"] + memory["stack_reserve_bytes"] <= profile.memory.ram_bytes
    refused = CliRunner().invoke(main, [*args[:-2], "--strips", "off"])
    assert refused.exit_code == 2 and "stem" in refused.output, refused.output
