"""`emulate` on a data set (issue 29, item 3): shuffled batches handed to the firmware one at a time
in one emulator run train it as the same batches train it in PyTorch, and --eval's accuracy is the
firmware's predict agreeing with PyTorch's eval-mode predictions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_as_typed

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_cli import assert_one_line_error, cli  # noqa: E402

from poet_opt.examples.torch_models import tiny_cnn  # noqa: E402
from poet_opt.firmware.trainer import emulate_training  # noqa: E402

CNN = "poet_opt.examples.torch_models:tiny_cnn"
LR, BATCH = 0.05, 2


def documented_order(n: int, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    """docs/firmware.md's rule, written out apart from the code: epoch e takes the e-th permutation
    (tests/test_digits.py uses it too)."""
    rng, out = np.random.default_rng(seed), []
    per_epoch = n // batch
    for step in range(steps):
        if step % per_epoch == 0:
            order = rng.permutation(n)
        k = step % per_epoch
        out.append(order[k * batch:(k + 1) * batch])
    return out


def _accuracy(module, x, y) -> float:
    """Eval mode (batch norm with the running statistics, as the firmware's predict), whole batches
    only; predicting moves no running statistics, here as on the board."""
    whole = x.shape[0] // BATCH * BATCH
    right = 0
    module.eval()
    with torch.no_grad():
        for k in range(0, whole, BATCH):
            logits = module(torch.from_numpy(x[k:k + BATCH]))
            right += int((logits.argmax(1).numpy() == y[k:k + BATCH]).sum())
    module.train()
    return right / whole


def _torch_reference(x, y, steps: int, seed: int, ex, ey):
    module = tiny_cnn()
    module.train()
    before = _accuracy(module, ex, ey)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for ix in documented_order(x.shape[0], BATCH, steps, seed):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x[ix])), torch.from_numpy(y[ix]).long())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = _accuracy(module, ex, ey)
    state = {n: t.detach().numpy() for n, t in module.state_dict().items() if not n.endswith("num_batches_tracked")}
    return losses, state, before, after


def _assert_equal_to_torch(weights, losses, reference):
    ref_losses, ref_weights, _, _ = reference
    largest = max(float(np.abs(w).max()) for w in ref_weights.values())
    assert set(weights) == set(ref_weights)
    for name, w in ref_weights.items():
        assert np.abs(np.asarray(weights[name]) - w).max() <= 1e-4 * largest, name
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
    assert len(set(np.round(ref_losses, 4))) == len(ref_losses)  # each step saw another batch


def test_the_docs_data_set_command_trains_as_torch_sgd_on_the_same_shuffled_batches(tmp_path):
    """docs/firmware.md "Training on a data set", run as written: 3 batches x 2 epochs."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "firmware.md").read_text()
    block = re.search(r"```sh\n(.*?)```", doc[doc.index("## Training on a data set"):], re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    runs = run_as_typed(commands, tmp_path)
    printed, done = [r.stdout for r in runs], runs[-1]
    assert "\r" not in done.stderr, "a progress bar on stderr that is no terminal"
    summary = json.loads(printed[-1])
    with np.load(tmp_path / "train.npz") as d:
        x, y = d["x"], d["y"]
    with np.load(tmp_path / "eval.npz") as d:
        ex, ey = d["x"], d["y"]
    reference = _torch_reference(x, y, 6, 0, ex, ey)
    with np.load(tmp_path / "tuned.npz") as trained:
        _assert_equal_to_torch({n: trained[n] for n in trained.files}, summary["loss"], reference)
    assert summary["steps"] == 6 and summary["batches_per_epoch"] == 3 and summary["epochs"] == 2
    assert summary["epoch_loss"] == pytest.approx([np.mean(summary["loss"][:3]), np.mean(summary["loss"][3:])])
    assert summary["eval_samples"] == 4  # 5 samples: the last partial batch is dropped
    assert (summary["accuracy_before"], summary["accuracy_after"]) == (reference[2], reference[3])


def test_steps_run_on_into_the_next_epoch_with_a_bar_on_stderr(tmp_path, capsys):
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((6, 3, 16, 16)).astype(np.float32), rng.integers(0, 4, 6)
    ex, ey = rng.standard_normal((4, 3, 16, 16)).astype(np.float32), rng.integers(0, 4, 4)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.savez(tmp_path / "e.npz", x=ex, y=ey)
    result = emulate_training(torch_model=CNN, input_shape="4,3,16,16", batch_size=BATCH, device="stm32f746",
                              ram="20KiB", steps=4, seed=7, lr=LR, data=tmp_path / "d.npz",
                              eval_data=tmp_path / "e.npz", time_limit=10, bar=True)
    reference = _torch_reference(x, y, 4, 7, ex, ey)
    _assert_equal_to_torch({**result.weights, **result.running}, result.losses, reference)
    summary = result.summary()
    assert summary["epoch_loss"] == pytest.approx([np.mean(result.losses[:3]), result.losses[3]])
    assert (summary["accuracy_before"], summary["accuracy_after"]) == (reference[2], reference[3])
    err = capsys.readouterr().err
    assert "epoch 2/2" in err and "4/4" in err and "loss=" in err
    assert "accuracy" in result.text("stm32f746")
    from dataclasses import replace

    long = replace(result, losses=result.losses * 300).summary()  # 1,200 steps: the means only
    assert long["loss"] is None and long["epoch_loss"] == summary["epoch_loss"]


@pytest.mark.parametrize("extra, option, words", [
    (("--steps", 2, "--epochs", 1), "--epochs", ["one of the two"]),
    (("--epochs", 1, "--batch-size", 0), "--batch-size", ["positive"]),
    (("--epochs", 1, "--batch-size", 4), "--batch-size", ["6 samples", "batches of 4"]),
    (("--epochs", 1, "--batch-size", 8), "--data", ["fewer than one batch of 8"]),
    (("--epochs", 1, "--seed", -1), "--seed", []),
])
def test_bad_combinations_are_refused_before_the_solve(tmp_path, extra, option, words):
    np.savez(tmp_path / "d.npz", x=np.zeros((6, 3, 16, 16), np.float32), y=np.zeros(6, np.int64))
    result = cli("emulate", "--torch", CNN, "--input-shape", "2,3,16,16", "--device", "stm32f746", "--ram", "20KiB",
                 "--lr", LR, "--data", tmp_path / "d.npz", "-q", "--weights-out", tmp_path / "w.npz", *extra)
    assert_one_line_error(result, option, *words)
    assert not (tmp_path / "w.npz").exists()


def test_labels_outside_the_classes_are_refused_naming_the_file_they_are_in(tmp_path):
    good, bad = np.zeros(6, np.int64), np.array([0, 1, 2, 3, 4, 0])
    np.savez(tmp_path / "good.npz", x=np.zeros((6, 3, 16, 16), np.float32), y=good)
    np.savez(tmp_path / "bad.npz", x=np.zeros((6, 3, 16, 16), np.float32), y=bad)
    for data, eval_data, option in (("bad", "good", "--data"), ("good", "bad", "--eval")):
        result = cli("emulate", "--torch", CNN, "--input-shape", "2,3,16,16", "--device", "stm32f746", "--ram", "20KiB",
                     "--lr", LR, "--epochs", 1, "--data", tmp_path / f"{data}.npz",
                     "--eval", tmp_path / f"{eval_data}.npz", "--time-limit", 5, "-q")
        assert_one_line_error(result, option, "label 4", "[0, 4)")


def test_a_uint64_label_past_int64_is_named_as_given(tmp_path):
    huge = np.array([0, 1, 2, 2**63 + 5, 3, 0], dtype=np.uint64)
    np.savez(tmp_path / "d.npz", x=np.zeros((6, 3, 16, 16), np.float32), y=huge)
    result = cli("emulate", "--torch", CNN, "--input-shape", "2,3,16,16", "--device", "stm32f746", "--ram", "20KiB",
                 "--lr", LR, "--epochs", 1, "--data", tmp_path / "d.npz", "--time-limit", 5, "-q")
    assert_one_line_error(result, "--data", f"label {2**63 + 5} is outside [0, 4)")


def test_an_output_onto_the_eval_set_is_refused_before_the_solve(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.zeros((6, 3, 16, 16), np.float32), y=np.zeros(6, np.int64))
    np.savez(tmp_path / "e.npz", x=np.zeros((2, 3, 16, 16), np.float32), y=np.zeros(2, np.int64))
    before = (tmp_path / "e.npz").read_bytes()
    result = cli("emulate", "--torch", CNN, "--input-shape", "2,3,16,16", "--device", "stm32f746", "--ram", "20KiB",
                 "--lr", LR, "--epochs", 1, "--data", tmp_path / "d.npz", "--eval", tmp_path / "e.npz", "-q",
                 "--weights-out", tmp_path / "e.npz")
    assert_one_line_error(result, "--weights-out", "--eval")
    assert (tmp_path / "e.npz").read_bytes() == before


def test_ctrl_c_while_the_host_hands_over_batches_stops_at_once(tmp_path):
    """The host's turns run on the emulator's thread: a Ctrl-C still ends the run within a moment."""
    import signal
    import time

    from conftest import default_sigint

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((6, 3, 16, 16)).astype(np.float32), y=rng.integers(0, 4, 6))
    out = tmp_path / "kept"
    proc = subprocess.Popen([sys.executable, "-m", "poet_opt.cli", "emulate", "--torch", CNN, "--input-shape",
                             "2,3,16,16", "--device", "stm32f746", "--ram", "20KiB", "--epochs", "100000", "--lr",
                             "0.01", "--data", str(tmp_path / "d.npz"), "--time-limit", "10", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline, seen = time.monotonic() + 120, ""
        while "training" not in seen and time.monotonic() < deadline:
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
