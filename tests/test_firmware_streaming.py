"""Streamed weights: firmware that trains a network whose weights live on the board's storage.

Each layer's weights are read from the emulated SD card or NOR flash into the arena when the
schedule computes its ``param:`` node, and the node that updates them folds the weight gradient
into an SGD step in place and writes them back. The trained weights, read back from the storage,
must equal torch.optim.SGD on the same module and batch, with the whole image in the device's RAM."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_firmware_training import LR, STEPS, check_against_torch  # noqa: E402
from test_firmware_training import _batch as _labelled_batch  # noqa: E402

from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import streamed_cnn, wide_mlp  # noqa: E402
from poet_opt.firmware import arena, codegen  # noqa: E402
from poet_opt.firmware.trainer import emulate_training  # noqa: E402

MLP = "poet_opt.examples.torch_models:wide_mlp"
CNN = "poet_opt.examples.torch_models:streamed_cnn"
SD_BLOCK = 512  # the nRF52840 profile's SD card writes whole blocks


def _batch(tmp_path_factory, name, shape, classes):
    return _labelled_batch(tmp_path_factory, name, shape, np.arange(shape[0]) % classes)


@pytest.fixture(scope="module")
def mlp_batch(tmp_path_factory):
    return _batch(tmp_path_factory, "mlp", (4, 160), 10)


@pytest.fixture(scope="module")
def cnn_batch(tmp_path_factory):
    return _batch(tmp_path_factory, "cnn", (2, 3, 16, 16), 4)


def _nodes(result) -> list[dict]:
    return result.schedule.to_dict()["graph"]["nodes"]


def _params(result) -> dict[str, dict]:
    return {n["name"]: n for n in _nodes(result) if n["op"] == "param"}


def _report(result) -> None:
    per_step = result.flash_bytes_written / len(result.losses)
    print(f"\n{result.network.name}: RAM {result.ram_used_bytes:,} of {result.ram_device_bytes:,} B, streamed weights "
          f"{result.network.graph.streamed_param_bytes:,} B, storage written {per_step:,.0f} B/step "
          f"(plan {result.flash_bytes_written_per_step:,}), read {result.flash_bytes_read / len(result.losses):,.0f} "
          f"B/step, lifetime {result.flash_lifetime_steps} steps, {result.instructions_per_step:,.0f} instructions/step")


def test_an_mlp_with_weights_three_times_the_ram_trains_on_nrf52840_as_in_torch(mlp_batch):
    result = emulate_training(torch_model=MLP, input_shape="4,160", device="nrf52840", ram="200KiB", steps=STEPS,
                              lr=LR, data=mlp_batch, weights="streamed")
    _report(result)
    assert result.weights_placement == "streamed"
    assert result.network.graph.streamed_param_bytes > 3 * result.ram_device_bytes
    check_against_torch(result, wide_mlp(), mlp_batch)  # also: RAM used <= the device's, no storage violations
    # each layer is read, updated in place and written back once a step: its region, whole SD blocks
    for name, node in _params(result).items():
        assert result.region_bytes_written[name] == STEPS * -(-node["bytes"] // SD_BLOCK) * SD_BLOCK, name
    assert sum(result.region_bytes_written.values()) == result.flash_bytes_written
    assert result.flash_bytes_read >= STEPS * result.network.graph.streamed_param_bytes
    summary = result.summary()
    assert summary["weights"] == "streamed" and summary["flash_lifetime_steps"] > 0
    # the card's wear as the emulator counts it (each allocation unit a write command touches) is
    # what the flash plan's lifetime says, and no more than the schedule's worst case
    storage = result.schedule.profile.storage
    worn_per_step = result.flash_wear_events * storage.erase_block_bytes // STEPS
    assert 0 < worn_per_step <= result.schedule.erased_bytes_per_step()
    if storage.sequential_writes:  # the step's writes as one log: the plan's count is exact
        assert worn_per_step == result.schedule.erased_bytes_per_step()
    assert result.flash_lifetime_steps == storage.endurance_cycles * storage.capacity_bytes // worn_per_step
    assert result.flash_lifetime_steps >= result.schedule.lifetime_steps()
    assert summary["flash_bytes_written_per_step"] == result.schedule.to_dict()["totals"]["storage_written_bytes"]


def test_frozen_layers_are_read_from_storage_and_never_written(mlp_batch):
    result = emulate_training(torch_model=MLP, input_shape="4,160", device="nrf52840", ram="200KiB", steps=STEPS,
                              lr=LR, data=mlp_batch, weights="auto", trainable="last:2")
    _report(result)
    # two trained layers and their gradients (1.6 MB) would not fit beside the arena: auto streams
    assert result.weights_placement == "streamed"
    assert sorted(result.weights) == ["body.14.bias", "body.14.weight", "fc.bias", "fc.weight"]
    check_against_torch(result, wide_mlp(), mlp_batch)
    params = _params(result)
    # the two trained layers' regions, in slices where one exceeds the default tile (a quarter of --ram)
    trained = {name for name in params if name.split("#")[0] in ("param:body.14", "param:fc")}
    assert {name.split("#")[0] for name in trained} == {"param:body.14", "param:fc"} and trained < params.keys()
    for name in params.keys() - trained:
        assert result.region_bytes_written[name] == 0, name
    written = sum(STEPS * -(-params[name]["bytes"] // SD_BLOCK) * SD_BLOCK for name in trained)
    paged = sum(v for name, v in result.region_bytes_written.items() if name not in params)
    assert result.flash_bytes_written == written + paged
    # every layer's weights are still read: the forward pass needs them all
    assert result.flash_bytes_read >= STEPS * sum(node["bytes"] for node in params.values())


@pytest.mark.parametrize("device, ram, mode", [("nrf52840", "16KiB", "joint"), ("stm32f746", "16KiB", "paging")])
def test_a_cnn_with_batch_norm_streams_its_weights_as_in_torch(cnn_batch, device, ram, mode, tmp_path):
    out = tmp_path / "build"
    result = emulate_training(torch_model=CNN, input_shape="2,3,16,16", device=device, ram=ram, steps=STEPS, lr=LR,
                              data=cnn_batch, weights="streamed", mode=mode, out_dir=out)
    _report(result)
    ops = {layer.op for layer in result.network.layers.values()}
    assert {"conv2d", "batchnorm", "relu", "global_avgpool", "linear"} <= ops
    assert any(n["name"].startswith("update:") for n in _nodes(result))  # conv1's input needs no gradient
    check_against_torch(result, streamed_cnn(), cnn_batch)
    if mode == "paging":  # QSPI NOR flash: weights and activations share it, each region erased before it is programmed
        assert any(s["op"] == "page_out" for s in result.schedule.to_dict()["steps"])
        assert result.flash_erases_max_block == STEPS
    # the board is provisioned with the image the emulator started from
    image = np.frombuffer((out / "poet_weights.bin").read_bytes(), np.uint8)
    flash = arena.plan_flash(result.schedule.to_dict())
    for node, layer in codegen.param_layers(result.network, result.schedule.to_dict()).items():
        packed = codegen.packed_params(layer)
        assert np.array_equal(image[flash.offsets[node]:flash.offsets[node] + packed.nbytes].view(np.float32), packed)
    assert "poet_linear_backward_params_sgd" in (out / "poet_train.c").read_text()


class _LayerNormNet(torch.nn.Module):
    """Layer norm, a bias-free linear layer, and two trained layers reading one tensor, whose
    gradient is then summed over a chain of nodes, each holding one user's weights and updating them."""

    def __init__(self):
        super().__init__()
        self.fc0, self.ln = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16, bias=False)
        self.relu, self.fc = torch.nn.ReLU(), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.ln(self.fc0(x))
        return self.fc(self.relu(self.a(h) + self.b(h)))


def layer_norm_net():
    torch.manual_seed(0)
    return _LayerNormNet()


def test_layer_norm_and_a_gradient_summed_over_a_chain_of_updates(tmp_path_factory):
    data = _batch(tmp_path_factory, "ln", (3, 8), 4)
    result = emulate_training(torch_model=layer_norm_net, input_shape="3,8", device="nrf52840", ram="4KiB",
                              steps=STEPS, lr=LR, data=data, weights="streamed")
    nodes = _nodes(result)
    assert any("@" in n["name"] and n["updates"] for n in nodes) and any(n["name"] == "grad:ln" for n in nodes)
    check_against_torch(result, layer_norm_net(), data)


def _streamed_plan(network, ram="200KiB"):
    from poet_opt.firmware.fit import solve_for_export

    return solve_for_export(network.graph, "nrf52840", ram=ram, time_limit=60)


def test_the_flash_plan_gives_every_weight_tensor_its_own_region_frozen_first_trained_in_the_log():
    from poet_opt.model.network import lower_network

    network = lower_network(wide_mlp(), (4, 160), trainable="last:3", weights="streamed")
    plan = _streamed_plan(network)
    doc = plan.schedule.to_dict()
    flash = plan.flash
    arena.check_flash(flash)
    nodes = doc["graph"]["nodes"]
    params = [n for n, node in enumerate(nodes) if node["op"] == "param"]
    updated = {p for node in nodes for p in node["updates"]}
    frozen = [n for n in params if n not in updated]
    # the nRF52840's card appends sequential writes (docs/wear.md): the frozen weights first, in node
    # order; the trained ones in the step's write log, in the order the step writes them, from an AU
    written = list(dict.fromkeys(p for s in doc["steps"] if s["op"] == "compute" for p in nodes[s["node"]]["updates"]))
    assert flash.params == frozen + written and flash.log
    assert [flash.offsets[n] for n in flash.params] == sorted(flash.offsets[n] for n in flash.params)
    assert flash.offsets[frozen[0]] == 0 and flash.param_bytes == sum(flash.region_bytes[n] for n in params)
    assert flash.offsets[flash.log[0]] % doc["device"]["erase_block_bytes"] == 0
    assert len(updated) == 3 and set(flash.writes_per_step) >= updated
    assert all(flash.writes_per_step[p] == 1 for p in updated)
    assert not (set(params) - updated) & set(flash.writes_per_step)  # frozen weights are never written
    assert flash.bytes_written_per_step == doc["totals"]["storage_written_bytes"]


def test_a_schedule_that_recomputes_an_update_is_refused():
    """Its data gradients would read weights it has already changed in place."""
    import copy

    from poet_opt.model.network import lower_network

    network = lower_network(wide_mlp(), (4, 160), trainable="last:2", weights="streamed")
    doc = copy.deepcopy(_streamed_plan(network).schedule.to_dict())
    nodes = doc["graph"]["nodes"]
    k = next(k for k, s in enumerate(doc["steps"]) if s["op"] == "compute" and nodes[s["node"]]["updates"]
             and nodes[s["node"]]["bytes"])
    n = doc["steps"][k]["node"]
    doc["steps"][k + 1:k + 1] = [{"op": "free", "node": n}, {"op": "compute", "node": n}]
    plan = arena.plan_arena(doc)
    with pytest.raises(PoetError, match="after node .* updated them in place"):
        codegen.generate(network, doc, plan, arena.plan_flash(doc), steps=1, lr=LR,
                         x=np.zeros((4, 160), np.float32), y=np.zeros(4, np.int64))


def test_resident_weights_generate_what_they_always_did(mlp_batch):
    """No param nodes: static weights and the end-of-step SGD, no weight reads from storage."""
    from poet_opt.model.network import lower_network

    network = lower_network(wide_mlp(), (4, 160), trainable="last:1")
    assert not network.graph.streams_weights
    plan = _streamed_plan(network, ram="64KiB")
    assert not plan.flash.params
    source = codegen.generate(network, plan.schedule.to_dict(), plan.arena, plan.flash, steps=1, lr=LR,
                              x=np.zeros((4, 160), np.float32), y=np.zeros(4, np.int64)).source
    assert "poet_sgd_step" in source and "_sgd(" not in source and "Streamed weights" not in source


def test_the_fused_update_kernels_equal_the_gradient_then_sgd_bit_for_bit(tmp_path):
    """Each *_backward_params_sgd forms the very sums *_backward_params does and applies them as
    poet_sgd_step does: streaming changes where the gradient lives, not a bit of the result."""
    import ctypes as C

    from kernel_host import BN, CONV, FL, BatchNormShape, F, Kernels, U, conv_shape, ptr

    from poet_opt.firmware import toolchain

    k = Kernels(toolchain.compile_host_library(tmp_path / "libpoet_kernels.so"))
    for name, args in {"linear_backward_params_sgd": [F, F, F, F, U, U, U, FL],
                       "conv2d_backward_params_sgd": [F, F, F, F, CONV, FL],
                       "batchnorm_backward_params_sgd": [F, F, F, F, F, F, BN, FL],
                       "layernorm_backward_params_sgd": [F, F, F, F, F, F, U, U, FL]}.items():
        fn = getattr(k, name)
        fn.restype, fn.argtypes = None, args
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def reference(n_grads, backward):
        """Gradients into zeroed buffers, then poet_sgd_step on each parameter."""
        params = [rand(n) for n in n_grads]
        grads = [np.zeros(n, np.float32) for n in n_grads]
        updated = [p.copy() for p in params]
        backward(*[ptr(g) for g in grads])
        for p, g in zip(updated, grads):
            k.sgd_step(ptr(p), ptr(g), p.size, LR)
        return params, updated

    # tiles, and one row (its own out-of-line kernel: a head's few outputs in steps of 8 inputs)
    for rows, d_in, d_out in ((5, 7, 3), (1, 9, 2), (1, 64, 2), (1, 13, 3), (1, 6, 7)):
        x, dy = rand(rows, d_in), rand(rows, d_out)
        params, want = reference([d_in * d_out, d_out], lambda gw, gb: k.linear_backward_params(
            gw, gb, ptr(dy), ptr(x), rows, d_in, d_out))
        k.linear_backward_params_sgd(ptr(params[0]), ptr(params[1]), ptr(dy), ptr(x), rows, d_in, d_out, LR)
        assert all(np.array_equal(a, b) for a, b in zip(params, want))

    s = conv_shape(2, 4, 6, 6, 4, (3, 3), (2, 2), (1, 1), 2)
    x, dy = rand(2, 4, 6, 6), rand(2, 4, s.h_out, s.w_out)
    params, want = reference([4 * 2 * 9, 4], lambda gw, gb: k.conv2d_backward_params(gw, gb, ptr(dy), ptr(x),
                                                                                     C.byref(s)))
    k.conv2d_backward_params_sgd(ptr(params[0]), ptr(params[1]), ptr(dy), ptr(x), C.byref(s), LR)
    assert all(np.array_equal(a, b) for a, b in zip(params, want))

    bn = BatchNormShape(2, 3, 4, 1e-5, 0.1)
    x, dy, mean, invstd = rand(2, 3, 4), rand(2, 3, 4), rand(3), np.abs(rand(3)) + 0.5
    gamma = rand(3)
    params, want = reference([3, 3], lambda dg, db: k.batchnorm_backward(None, dg, db, ptr(dy), ptr(x), ptr(mean),
                                                                         ptr(invstd), ptr(gamma), C.byref(bn)))
    k.batchnorm_backward_params_sgd(ptr(params[0]), ptr(params[1]), ptr(dy), ptr(x), ptr(mean), ptr(invstd),
                                    C.byref(bn), LR)
    assert all(np.array_equal(a, b) for a, b in zip(params, want))

    x, dy, mean, invstd = rand(4, 6), rand(4, 6), rand(4), np.abs(rand(4)) + 0.5
    params, want = reference([6, 6], lambda dg, db: k.layernorm_backward(None, dg, db, ptr(dy), ptr(x), ptr(mean),
                                                                         ptr(invstd), None, 4, 6))
    k.layernorm_backward_params_sgd(ptr(params[0]), ptr(params[1]), ptr(dy), ptr(x), ptr(mean), ptr(invstd), 4, 6, LR)
    assert all(np.array_equal(a, b) for a, b in zip(params, want))
