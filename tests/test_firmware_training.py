"""Generated firmware trains on the emulated Cortex-M exactly as PyTorch does.

Each case solves a schedule, generates the C training step, cross-compiles it with zig, runs three
SGD steps in unicorn with exactly the device's RAM, and compares the trained weights with three
steps of torch.optim.SGD on the same module and batch."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from conftest import default_sigint, run_as_typed

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_cli import assert_one_line_error, cli  # noqa: E402

from poet_opt.examples.torch_models import tiny_cnn  # noqa: E402
from poet_opt.model.zoo_twins import zoo_module  # noqa: E402
from poet_opt.firmware.trainer import emulate_training  # noqa: E402

STEPS, LR = 3, 0.05
CNN = "poet_opt.examples.torch_models:tiny_cnn"


def _batch(tmp_path_factory, name, shape, labels):
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("data") / f"{name}.npz"
    np.savez(path, x=rng.standard_normal(shape).astype(np.float32), y=np.asarray(labels, dtype=np.int64))
    return path


@pytest.fixture(scope="module")
def vww_batch(tmp_path_factory):
    return _batch(tmp_path_factory, "vww", (1, 1, 96, 96), [1])


@pytest.fixture(scope="module")
def cnn_batch(tmp_path_factory):
    return _batch(tmp_path_factory, "cnn", (2, 3, 32, 32), [1, 3])


def torch_sgd(module, data, trainable_names, steps=STEPS, lr=LR):
    """The reference: plain PyTorch training of the same module on the same batch."""
    with np.load(data) as d:
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    module.train()
    params = []
    for name, p in module.named_parameters():
        p.requires_grad_(name in trainable_names)
        if name in trainable_names:
            params.append(p)
    opt = torch.optim.SGD(params, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in module.named_parameters() if n in trainable_names}


def check_against_torch(result, reference_module, data):
    assert result.weights, "nothing was trained"
    losses, weights = torch_sgd(reference_module, data, set(result.weights))
    assert set(weights) == set(result.weights)
    largest = max(float(np.abs(w).max()) for w in weights.values())
    worst = max(float(np.abs(result.weights[n] - w).max()) for n, w in weights.items())
    print(f"\n{result.network.name}: max |firmware - torch| = {worst:.3g} ({worst / largest:.3g} of the largest weight)")
    assert worst <= 1e-4 * largest
    assert np.allclose(result.losses, losses, rtol=1e-4, atol=1e-6)
    assert result.losses[-1] < result.losses[0]
    assert all(b < a for a, b in zip(result.losses, result.losses[1:]))
    assert result.ram_used_bytes <= result.ram_device_bytes
    assert not result.flash_violations


def step_counts(result) -> Counter:
    return Counter(s["op"] for s in result.schedule.to_dict()["steps"])


def test_mcu_vww_recomputes_on_nrf52840_and_matches_torch(vww_batch):
    result = emulate_training(model="mcu-vww", device="nrf52840", ram="150KiB", steps=STEPS, lr=LR, data=vww_batch)
    counts = step_counts(result)
    nodes = len(result.schedule.to_dict()["graph"]["nodes"])
    assert counts["compute"] > nodes, "the budget should force recomputation"
    assert result.network.graph.plain_peak_bytes() > 150 * 1024
    check_against_torch(result, zoo_module("mcu-vww"), vww_batch)
    assert result.instructions > 0


def test_mcu_vww_pages_to_the_sd_card_and_matches_torch(vww_batch):
    result = emulate_training(model="mcu-vww", device="nrf52840", ram="150KiB", steps=STEPS, lr=LR, data=vww_batch,
                              mode="paging")
    counts = step_counts(result)
    assert counts["page_out"] > 0 and counts["page_in"] > 0
    assert result.flash_bytes_written > 0
    check_against_torch(result, zoo_module("mcu-vww"), vww_batch)


@pytest.mark.parametrize("mode", ["joint", "paging"])
def test_a_torch_cnn_trains_on_stm32f746_as_in_torch(cnn_batch, mode):
    result = emulate_training(torch_model=CNN, input_shape="2,3,32,32", device="stm32f746", ram="76KiB",
                              steps=STEPS, lr=LR, data=cnn_batch, mode=mode)
    ops = {layer.op for layer in result.network.layers.values()}
    assert {"conv2d", "batchnorm", "relu6", "add", "maxpool", "global_avgpool", "linear"} <= ops
    assert any(layer.op == "conv2d" and layer.attrs["groups"] > 1 for layer in result.network.layers.values())
    counts = step_counts(result)
    if mode == "joint":
        assert counts["compute"] > len(result.schedule.to_dict()["graph"]["nodes"])
    else:  # QSPI NOR flash: every page-out erases its blocks first, and no write hits a 0 bit
        assert counts["page_out"] > 0 and result.flash_erases_max_block >= STEPS
    check_against_torch(result, tiny_cnn(), cnn_batch)


def test_cli_emulate_prints_json_and_keeps_what_it_was_asked_to(cnn_batch, tmp_path):
    weights, out = tmp_path / "after.npz", tmp_path / "build"
    result = cli("emulate", "--torch", CNN, "--input-shape", "2,3,32,32", "--device", "nrf52840", "--ram", "80KiB",
                 "--steps", 2, "--lr", 0.1, "--data", cnn_batch, "--trainable", "last:2", "--weights-out", weights,
                 "--json", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert set(summary) == {"steps", "loss", "ram_device_bytes", "ram_used_bytes", "flash_bytes_written",
                            "flash_erases_max_block", "instructions", "cycles", "predicted_runtime_s_per_step",
                            "predicted_energy_j_per_step", "estimated_runtime_s_per_step", "estimated_over_predicted",
                            "storage_bus_s_per_step", "costs"}
    # the M4F's table costs at least a cycle per instruction; seconds from the nRF52840's 64 MHz
    assert summary["cycles"] >= summary["instructions"] > 0
    # plus the storage commands at the SD card's rates: at least the input batch or a page-out, if any
    assert summary["estimated_runtime_s_per_step"] == pytest.approx(summary["cycles"] / 2 / 64e6
                                                                     + summary["storage_bus_s_per_step"])
    assert summary["predicted_runtime_s_per_step"] > 0
    assert summary["estimated_over_predicted"] == pytest.approx(summary["estimated_runtime_s_per_step"]
                                                                / summary["predicted_runtime_s_per_step"])
    assert summary["costs"] is None  # the profile's own costs: no --costs file
    assert summary["steps"] == 2 and len(summary["loss"]) == 2 and summary["ram_device_bytes"] == 256 * 1024
    with np.load(weights) as trained:
        reference = {**dict(tiny_cnn().named_parameters()), **dict(tiny_cnn().named_buffers())}
        # the trained parameters, and every batch norm's running statistics (frozen or not, as torch's move)
        running = [f"{bn}_bn.{s}" for bn in ("stem", "dw", "pw", "head") for s in ("running_mean", "running_var")]
        assert sorted(trained.files) == sorted(["fc.bias", "fc.weight", "head_bn.bias", "head_bn.weight", *running])
        for name in trained.files:
            assert trained[name].shape == tuple(reference[name].shape)
    assert (out / "poet_train.elf").is_file() and (out / "poet_train.c").is_file()
    assert (out / "poet_storage.h").is_file() and (out / "poet_kernels.h").is_file()


def test_generated_sources_compile_strictly_for_the_host(cnn_batch, tmp_path):
    """The cross build already uses -std=c99 -Wall -Wextra -Werror -pedantic; the kept sources
    also compile so for another target (the host's), as a board project's compiler would."""
    import subprocess
    import sys

    out = tmp_path / "src"
    emulate_training(torch_model=CNN, input_shape="2,3,32,32", device="stm32f746", ram="76KiB", steps=1, lr=LR,
                     data=cnn_batch, mode="paging", out_dir=out)
    cmd = [sys.executable, "-m", "ziglang", "cc", "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic",
           "-c", "-DPOET_STORAGE_CAPACITY_BYTES=16777216ULL", "-DPOET_STORAGE_ERASE_BLOCK_BYTES=65536u",
           "-DPOET_STORAGE_WRITE_BLOCK_BYTES=1u", "-DPOET_STORAGE_ERASE_REQUIRED=1", f"-I{out}",
           "-o", str(tmp_path / "step.o"), str(out / "poet_train.c")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "step.o").stat().st_size > 0
    # a convolution that makes a gradient's first contribution writes it (dx =), with no poet_zero
    # before it: the depthwise layer's input gradient, and the stem's (a network input: none)
    assert "poet_conv2d_backward_input_set(" in (out / "poet_train.c").read_text()


# ---------------------------------------------------------------- bad input

def _emulate(*extra, data, model=("--model", "mcu-vww"), ram="150KiB", device="nrf52840"):
    return cli("emulate", *model, "--device", device, "--ram", ram, "--steps", 1, "--lr", 0.1, "--data", data, "-q",
               *extra)


def test_an_operator_without_a_kernel_names_the_operator_and_the_node(tmp_path):
    model = tmp_path / "sigmoid_net.py"  # sigmoid has no C kernels (tanh, used here before, has them now)
    model.write_text("import torch\nfrom torch import nn\n\n"
                     "def factory():\n    return nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2))\n")
    data = tmp_path / "b.npz"
    np.savez(data, x=np.ones((2, 4), np.float32), y=np.array([0, 1]))
    out = tmp_path / "w.npz"
    result = _emulate("--weights-out", out, "-o", tmp_path / "kept", data=data,
                      model=("--torch", f"{model}:factory", "--input-shape", "2,4"), ram="1KiB")
    assert_one_line_error(result, "Sigmoid", "'1'", "--torch", out=out)
    assert not (tmp_path / "kept").exists()


def test_a_batch_that_does_not_fit_the_model_is_refused(tmp_path):
    data = tmp_path / "b.npz"
    np.savez(data, x=np.ones((2, 3, 32, 32), np.float32), y=np.array([0, 1]))
    result = _emulate(data=data, model=("--torch", CNN, "--input-shape", "2,3,16,16"))
    assert_one_line_error(result, "--data", "2,3,32,32", "2,3,16,16")
    np.savez(data, x=np.ones((2, 3, 32, 32), np.float64), y=np.array([0, 1]))
    assert_one_line_error(_emulate(data=data, model=("--torch", CNN, "--input-shape", "2,3,32,32")),
                          "--data", "float32")


def test_an_arena_with_no_room_left_for_the_static_data_and_stack_is_solved_again_within_it(vww_batch):
    """--ram 240 KiB: the arena alone fits the 256 KiB, but not with the resident weights, their
    gradients and a stack. That was refused; the arena is now solved again within the RAM they
    leave (a device they leave too little of is refused: tests/test_emulate_statics.py), and the
    step trains as torch's (--weights auto would stream the weights: test_firmware_streaming.py)."""
    result = emulate_training(model="mcu-vww", device="nrf52840", ram="240KiB", steps=STEPS, lr=LR, data=vww_batch,
                              weights="resident")
    weights = sum(8 * p.value.size for p in result.network.trainable_parameters)  # and their gradients
    assert result.static_bytes - result.arena_bytes >= weights
    assert result.arena_bytes <= result.schedule.budgets.ram_bytes < 240 * 1024
    assert result.ram_used_bytes <= result.ram_device_bytes
    check_against_torch(result, zoo_module("mcu-vww"), vww_batch)


def test_a_device_the_emulator_has_no_core_for_is_refused(vww_batch, tmp_path):
    out = tmp_path / "w.npz"
    result = _emulate("--weights-out", out, data=vww_batch, device="rpi4")
    assert_one_line_error(result, "--device", "Cortex-A72", out=out)


def test_an_unknown_zoo_model_and_bad_labels_are_refused(vww_batch, tmp_path, monkeypatch):
    assert_one_line_error(_emulate(data=vww_batch, model=("--model", "resnet34")), "--model", "mcu-vww")
    data = tmp_path / "b.npz"
    np.savez(data, x=np.ones((1, 1, 96, 96), np.float32), y=np.array([7]))

    def no_solve(*args, **kwargs):  # labels are checked against the traced model's outputs, not after a solve
        raise AssertionError("solved before the labels were checked")

    monkeypatch.setattr("poet_opt.firmware.trainer.solve_for_export", no_solve)
    assert_one_line_error(_emulate(data=data), "--data", "[0, 2)")
    np.savez(data, x=np.ones((4, 1, 96, 96), np.float32), y=np.array([0, 1, 0, 2]))  # a data set: the 4th
    assert_one_line_error(_emulate("--batch-size", "2", data=data), "--data", "[0, 2)")
    np.savez(data, x=np.ones((2, 1, 96, 96), np.float32), y=np.array([0.0, 1.0]))
    line = assert_one_line_error(_emulate(data=data), "--data", "one integer label per sample")
    assert line.count("--data") == 1, line
    data.write_text("not a zip")
    assert_one_line_error(_emulate(data=data), "--data")


def test_ctrl_c_during_the_emulated_training_stops_it_at_once(vww_batch, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "kept"
    proc = subprocess.Popen([sys.executable, "-m", "poet_opt.cli", "emulate", "--model", "mcu-vww", "--device",
                             "nrf52840", "--ram", "150KiB", "--steps", "500", "--lr", "0.05", "--data", str(vww_batch),
                             "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while "training" not in seen and time.monotonic() < deadline:  # the emulation has begun
            seen += proc.stderr.readline()
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert waited < 3, f"took {waited:.1f} s to stop"
    assert "interrupted; nothing was written" in stderr and stdout == ""
    assert not out.exists()


def test_the_commands_in_docs_firmware_md_run(tmp_path):
    """Every line of docs/firmware.md's first sh block and its measured costs' block, as written, in a
    scratch directory."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "firmware.md").read_text()
    # the first block, and that of "Costs from the firmware itself" (the strips' block, "Training on a
    # data set" and "Fine-tuning on digits", tests/test_digits.py, have their own tests)
    costs = doc[doc.index("## Costs from the firmware itself"):]
    blocks = [re.search(r"```sh\n(.*?)```", text, re.S).group(1) for text in (doc, costs)]
    commands = [line for block in blocks for line in block.splitlines() if line.strip()]
    assert len(commands) == 5 and all(c.startswith(("python", "poet-opt")) for c in commands)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cnn-batch.npz", x=rng.standard_normal((2, 3, 32, 32)).astype(np.float32), y=np.array([1, 3]))
    runs = run_as_typed(commands, tmp_path)
    printed, done = [r.stdout for r in runs], runs[-1]
    assert (tmp_path / "build" / "poet_train.elf").is_file()
    with np.load(tmp_path / "after.npz") as trained:
        assert "fc.weight" in trained.files
    assert json.loads(printed[2])["steps"] == 3
    # "Costs from the firmware itself": the plan solved with the measured costs predicts its step
    assert (tmp_path / "vww-costs.csv").is_file()
    emulated = json.loads(printed[4])
    assert emulated["costs"] == "vww-costs.csv" and abs(emulated["estimated_over_predicted"] - 1) <= 0.10
