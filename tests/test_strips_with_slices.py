"""Activation strips and weight slices in one graph, through every path that lowers or runs it:
the torch lowering cuts both as the zoo does, the firmware trains such a plan equal to
torch.optim.SGD on the unsplit module (a slice over strips reads its channels of the concat's
gradient strips), and `solve --torch` and `solve --model` give the same graph for ResNet-18."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import strip_cnn  # noqa: E402
from poet_opt.model.network import lower_network  # noqa: E402
from poet_opt.model.tiling import feature_ranges  # noqa: E402

SHAPE = (1, 1, 96, 96)


def test_the_torch_lowering_cuts_strips_and_slices_together():
    net = lower_network(strip_cnn(), SHAPE, weights="streamed", strips=4, tile_bytes=1024)
    meta = net.graph.meta
    assert meta["tiles"]["head"].names == tuple(f"head#{j}" for j in range(len(meta["tiles"]["head"])))
    assert len(meta["tiles"]["head"]) > 1
    # every slice of the head's output is split into the head's strips, and reads the concat's gradient
    assert {f"head#{j}" for j in range(len(meta["tiles"]["head"]))} <= set(meta["strips"].grad_alias)
    assert "head#0@s1" in {n.name for n in net.graph.nodes}
    # each slice layer holds its rows of the torch weight, and the rows cover it once
    weight = dict(strip_cnn().named_parameters())["head.weight"].detach().numpy()
    ranges = feature_ranges(weight.shape[0], meta["tiles"]["head"])
    for name, (lo, hi) in ranges.items():
        assert np.array_equal(net.layers[name].params["weight"].value, weight[lo:hi])
    assert net.layers["head"].op == "concat" and net.layers["head"].attrs["bounds"] == list(ranges.values())


def test_the_strip_graph_with_slices_replays_to_torch_autograd():
    """The graph's maths, node by node in PyTorch (executor/strips.py), against autograd and one
    torch.optim.SGD step on the unsplit module."""
    from poet_opt.executor.strips import replay

    module = strip_cnn()
    net = lower_network(module, SHAPE, weights="streamed", strips=4, tile_bytes=1024)
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal(SHAPE).astype(np.float32))
    y = torch.tensor([2])
    params: dict = {}
    for name, layer in net.layers.items():
        if layer.params:
            params[name] = {role: torch.from_numpy(p.value.copy()) for role, p in layer.params.items()}
    out = replay(net.graph, params, x, y, lr=0.05)
    reference = strip_cnn()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    opt.step()
    assert abs(float(out["loss"].detach()) - float(loss.detach())) < 1e-5
    want = dict(reference.named_parameters())
    got = net.assemble({p.torch_name: [(p, params[name][role].numpy())]
                        for name, layer in net.layers.items() if layer.params
                        for role, p in layer.params.items()} | _tiles(net, params))
    for name, value in want.items():
        assert np.allclose(got[name], value.detach().numpy(), atol=1e-5), name


def _tiles(net, params) -> dict:
    """torch name -> [(tile parameter, its trained rows)] over every slice of a tiled layer."""
    out: dict = {}
    for name, layer in net.layers.items():
        for role, p in layer.params.items():
            if p.rows is not None:
                out.setdefault(p.torch_name, []).append((p, params[name][role].numpy()))
    return out


class _IndependentResNet(torch.nn.Module):
    """Written as users write CIFAR ResNets (not as the zoo's twin): the shortcut an
    ``nn.Sequential`` (empty when it is the identity), ReLU as a function, global pooling as
    ``F.adaptive_avg_pool2d`` followed by ``view``."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, 1, 1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.c1 = torch.nn.Conv2d(8, 16, 3, 2, 1, bias=False)
        self.b1 = torch.nn.BatchNorm2d(16)
        self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 1, 2, bias=False), torch.nn.BatchNorm2d(16))
        self.same = torch.nn.Sequential()
        self.linear = torch.nn.Linear(16, 3)

    def forward(self, x):
        out = torch.nn.functional.relu(self.bn(self.conv(x)))
        out = torch.nn.functional.relu(self.b1(self.c1(out)) + self.shortcut(out))
        out = self.same(out) + out
        out = torch.nn.functional.adaptive_avg_pool2d(out, 1).view(out.size(0), -1)
        return self.linear(out)


def test_a_resnet_written_independently_lowers_into_strips_and_replays_to_autograd():
    """Global pooling spelled as a function was taken for a (C, 1, 1) image, one strip read from
    many: an IndexError inside the strip builder (issue 27)."""
    from poet_opt.executor.strips import replay

    torch.manual_seed(0)
    module = _IndependentResNet()
    shape = (1, 1, 32, 32)
    net = lower_network(module, shape, weights="streamed", strips=4, tile_bytes=256)
    assert net.layers["adaptive_avg_pool2d"].op == "global_avgpool"
    assert net.graph.meta["strips"].tensors and net.graph.meta["tiles"]
    x = torch.from_numpy(np.random.default_rng(4).standard_normal(shape).astype(np.float32))
    y = torch.tensor([1])
    params = {name: {role: torch.from_numpy(p.value.copy()) for role, p in layer.params.items()}
              for name, layer in net.layers.items() if layer.params}
    out = replay(net.graph, params, x, y, lr=0.1)
    loss = torch.nn.functional.cross_entropy(module(x), y)
    assert abs(float(out["loss"].detach()) - float(loss.detach())) < 1e-5


def test_a_negative_strip_count_is_refused_naming_the_option():
    with pytest.raises(PoetError) as err:
        lower_network(strip_cnn(), SHAPE, weights="streamed", strips=0)
    assert err.value.field == "--strips"


def test_solve_gives_resnet18_the_same_graph_from_the_zoo_and_from_torch():
    """`solve --model resnet18-cifar` and `solve --torch ...:resnet18` at 200 KiB on the nRF52840:
    the same strips, slices, nodes and sizes, so the same plan (before, --torch was refused)."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.model.load import default_tile_bytes, load_training_graph

    profile = load_profile("nrf52840")
    common = dict(weights="auto", tile_bytes=default_tile_bytes([200 * 1024]), ram_bytes=200 * 1024,
                  device_ram_bytes=profile.memory.ram_bytes, stack_reserve_bytes=profile.memory.stack_reserve_bytes)
    zoo, _ = load_training_graph("resnet18-cifar", **common)
    traced, _ = load_training_graph(torch="poet_opt.examples.torch_models:resnet18", input_shape="1,3,32,32",
                                    **common)
    assert zoo.meta["strips"].per_height == traced.meta["strips"].per_height
    assert [(n.name, n.kind, n.bytes, n.deps, n.flops) for n in zoo.nodes] == \
        [(n.name, n.kind, n.bytes, n.deps, n.flops) for n in traced.nodes]


def test_the_importer_and_the_strip_builder_slice_the_same_features():
    """`solve --torch` without strips lowers through the importer (batch-first shapes), `run` through
    the strip builder (per-sample shapes, strips=1): the same nodes, sizes, inputs and trainable
    flags, and no slice over the tile. The importer's convolutions were once sliced over the batch
    axis (2 slices of 2,304 B at a 2 KiB tile; the strip builder cut 3 over the channels)."""
    import torch

    from poet_opt.examples.torch_models import tiny_cnn
    from poet_opt.model.network import lower_network
    from poet_opt.model.torch_import import import_torch

    torch.manual_seed(0)
    module = tiny_cnn()
    tile = 2048
    imported = import_torch(module, (2, 3, 32, 32), weights="streamed", tile_bytes=tile)
    lowered = lower_network(module, (2, 3, 32, 32), weights="streamed", strips=1, tile_bytes=tile).graph

    def nodes(g):
        return sorted((n.name, n.bytes, n.trainable, tuple(sorted(g.nodes[d].name for d in n.deps))) for n in g.nodes)

    assert nodes(imported) == nodes(lowered)
    params = [n for n in imported.nodes if n.op == "param"]
    assert any("#" in n.name for n in params), "the tile is small enough to slice some layer"
    assert all(n.bytes <= tile for n in params if "#" in n.name)
