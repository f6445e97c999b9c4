"""Weight tiles in firmware: a layer whose weights do not fit the RAM trains as slices of its output
features, each slice's weights read from the emulated storage, updated in place and written back on
their own, the slices' outputs joined by strided copies and the whole gradient handed back to each
slice by strided reads. The trained weights, reassembled from the slices, must equal
torch.optim.SGD on the whole module."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_cli import cli  # noqa: E402
from test_firmware_streaming import MLP, SD_BLOCK, _batch, _params  # noqa: E402
from test_firmware_training import LR, STEPS, check_against_torch  # noqa: E402

from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import tiled_cnn, wide_mlp  # noqa: E402
from poet_opt.firmware import codegen  # noqa: E402
from poet_opt.firmware.trainer import emulate_training  # noqa: E402
from poet_opt.units import parse_size  # noqa: E402

CNN = "poet_opt.examples.torch_models:tiled_cnn"


def _report(result) -> None:
    steps = len(result.losses)
    print(f"\n{result.network.name}: tiles {result.summary()['tiles']}, RAM {result.ram_used_bytes:,} of "
          f"{result.ram_device_bytes:,} B (arena {result.arena_bytes:,}), {result.instructions_per_step:,.0f} "
          f"instructions/step, storage read {result.flash_bytes_read / steps:,.0f} B/step, written "
          f"{result.flash_bytes_written / steps:,.0f} B/step (plan {result.flash_bytes_written_per_step:,})")


def _check_tiles(result, tile: str) -> None:
    """Every tile's weights fit the tile size, are read from their own region and written back once
    a step, whole SD blocks."""
    params = _params(result)
    tiles = result.network.graph.meta["tiles"]
    for layer, slices in tiles.items():
        assert result.network.layers[layer].op == "concat"
        names = slices.names
        assert [result.network.layers[n].operands for n in names] == [result.network.layers[names[0]].operands] * len(names)
        for name in names:
            node = params["param:" + name]
            assert node["bytes"] <= parse_size(tile)
            assert result.region_bytes_written["param:" + name] == STEPS * -(-node["bytes"] // SD_BLOCK) * SD_BLOCK


@pytest.fixture(scope="module")
def cnn_batch(tmp_path_factory):
    return _batch(tmp_path_factory, "cnn", (2, 3, 16, 16), 4)


def test_a_cnn_whose_linear_layer_exceeds_the_ram_trains_in_tiles_on_nrf52840(cnn_batch, tmp_path):
    out = tmp_path / "build"
    result = emulate_training(torch_model=CNN, input_shape="2,3,16,16", device="nrf52840", ram="96KiB", steps=STEPS,
                              lr=LR, data=cnn_batch, weights="streamed", tile_bytes="48KiB", mode="paging", out_dir=out)
    _report(result)
    module = tiled_cnn()
    assert 4 * module.fc1.weight.numel() > result.ram_device_bytes  # fc1 alone cannot be in RAM whole
    tiles = result.network.graph.meta["tiles"]
    assert len(tiles["fc1"]) == 7 and len(tiles["conv3"]) == 2  # a linear and a convolution, both tiled
    _check_tiles(result, "48KiB")
    check_against_torch(result, module, cnn_batch)  # also: RAM used <= the device's, no storage violations
    source = (out / "poet_train.c").read_text()
    assert "poet_copy_strided" in source and "poet_accumulate_strided" in source
    assert "fc1.weight[0:14] [14, 768]" in source  # the provisioning comment names each tile's rows
    # the image a board is provisioned with holds each tile's rows where its region is
    image = np.frombuffer((out / "poet_weights.bin").read_bytes(), np.uint8)
    doc = result.schedule.to_dict()
    flash = codegen.param_layers(result.network, doc)
    from poet_opt.firmware import arena

    regions = arena.plan_flash(doc)
    rows = []
    for node, layer in flash.items():
        packed = codegen.packed_params(layer)
        assert np.array_equal(image[regions.offsets[node]:regions.offsets[node] + packed.nbytes].view(np.float32),
                              packed)
        if layer.name.startswith("fc1#"):
            rows.append(layer.params["weight"].value)
    assert np.array_equal(np.concatenate(rows), tiled_cnn().fc1.weight.detach().numpy())  # (module is trained now)


def test_a_wide_mlp_trains_in_tiles_of_a_third_of_a_layer(tmp_path_factory):
    data = _batch(tmp_path_factory, "mlp", (4, 160), 10)
    result = emulate_training(torch_model=MLP, input_shape="4,160", device="nrf52840", ram="64KiB", steps=STEPS,
                              lr=LR, data=data, weights="streamed", tile_bytes="40KiB", mode="paging")
    _report(result)
    tiles = result.network.graph.meta["tiles"]
    assert set(tiles) == {f"body.{2 * k}" for k in range(8)} and all(len(t) == 3 for t in tiles.values())
    assert result.network.graph.streamed_param_bytes > 12 * parse_size("64KiB")
    _check_tiles(result, "40KiB")
    # each hidden layer's input gradient is summed over its three tiles, each updating its own weights
    nodes = result.schedule.to_dict()["graph"]["nodes"]
    assert sum(1 for n in nodes if "@" in n["name"] and n["updates"]) == 2 * 7
    check_against_torch(result, wide_mlp(), data)
    # untiled, one layer's weights with its input and output exceed the budget
    from poet_opt.firmware.fit import solve_for_export
    from poet_opt.model.network import lower_network

    whole = lower_network(wide_mlp(), (4, 160), weights="streamed")
    with pytest.raises(PoetError, match="smallest feasible budget"):
        solve_for_export(whole.graph, "nrf52840", ram="64KiB", time_limit=10, mode="paging")


TINY = """
import torch


def tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
"""


def test_emulate_takes_a_weight_tile_from_the_command_line(tmp_path):
    """Tiles of the first layer (whose input needs no gradient: each tile gets an update node of its
    own) and of the logits (the loss gradient is handed to each tile as its slice)."""
    (tmp_path / "tiny.py").write_text(TINY)
    data = tmp_path / "b.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.standard_normal((3, 8)).astype(np.float32), y=np.array([1, 3, 0]))
    args = ["emulate", "--torch", f"{tmp_path / 'tiny.py'}:tiny", "--input-shape", "3,8", "--device", "nrf52840",
            "--ram", "8KiB", "--steps", str(STEPS), "--lr", str(LR), "--data", data, "-q"]
    weights = tmp_path / "w.npz"
    result = cli(*args, "--weights", "streamed", "--weight-tile", "512B", "--json", "--weights-out", weights)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["tiles"] == {"0": 3, "2": 2}
    assert summary["ram_used_bytes"] <= summary["ram_device_bytes"]
    from test_firmware_training import torch_sgd

    namespace: dict = {}
    exec(TINY, namespace)
    losses, want = torch_sgd(namespace["tiny"](), data, {"0.weight", "0.bias", "2.weight", "2.bias"})
    got = np.load(weights)
    largest = max(float(np.abs(w).max()) for w in want.values())
    assert max(float(np.abs(got[n] - w).max()) for n, w in want.items()) <= 1e-4 * largest
    assert np.allclose(summary["loss"], losses, rtol=1e-4, atol=1e-6)
    refused = cli(*args, "--weights", "resident", "--weight-tile", "512B")
    assert refused.exit_code != 0 and "--weight-tile" in refused.output


def test_tiles_need_streamed_weights():
    from poet_opt.model.network import lower_network

    with pytest.raises(PoetError, match="streamed"):
        lower_network(wide_mlp(), (4, 160), tile_bytes=40 * 1024)


def test_the_strided_kernels_join_and_split_slices_of_the_feature_axis(tmp_path):
    """A concat of tiles is numpy's concatenate on the feature axis; each tile's gradient is its
    slice of the whole, added to what is there."""
    from kernel_host import F, U, Kernels, ptr

    from poet_opt.firmware import toolchain

    k = Kernels(toolchain.compile_host_library(tmp_path / "libpoet_kernels.so"))
    for name in ("copy_strided", "accumulate_strided"):
        fn = getattr(k, name)
        fn.restype, fn.argtypes = None, [F, F, U, U, U, U]
    rng = np.random.default_rng(0)
    for shape, axis in [((3, 10), 1), ((2, 7, 3, 4), 1)]:  # linear (batch, features), conv (N, C, H, W)
        bounds = [(0, 3), (3, 4), (4, shape[axis])]
        parts = [rng.standard_normal(shape[:axis] + (hi - lo,) + shape[axis + 1:]).astype(np.float32)
                 for lo, hi in bounds]
        whole = np.zeros(shape, np.float32)
        inner, outer = int(np.prod(shape[axis + 1:])), int(np.prod(shape[:axis]))
        for (lo, hi), part in zip(bounds, parts):
            count = (hi - lo) * inner
            k.copy_strided(ptr(whole.reshape(-1)[lo * inner:]), ptr(part), outer, count, shape[axis] * inner, count)
        assert np.array_equal(whole, np.concatenate(parts, axis))
        for (lo, hi), part in zip(bounds, parts):
            count = (hi - lo) * inner
            before = part.copy()
            k.accumulate_strided(ptr(part), ptr(whole.reshape(-1)[lo * inner:]), outer, count, count,
                                 shape[axis] * inner)
            assert np.array_equal(part, before + np.take(whole, range(lo, hi), axis))
