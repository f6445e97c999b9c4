"""The firmware runs row-tile plans (issue 27, item 5): a transformer written out in PyTorch, its
tokens in row blocks and its features in pieces (model/rows.py), trains on the emulated core as one
torch.optim.SGD step does (firmware/row_codegen.py); what it has no row kernel for is refused
before solving, naming the option. The full-size encoder block of the issue at 200 KiB is in
benchmarks/FIRMWARE.md ("Row tiles"): minutes, too long for the suite."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_cli import assert_one_line_error, cli  # noqa: E402
from test_support_matrix import LR, emulate_rows, worst_against_sgd  # noqa: E402

from poet_opt.examples.torch_models import small_encoder_classifier  # noqa: E402

SPEC = "poet_opt.examples.torch_models:small_encoder_classifier"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def batch(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "batch.npz"
    np.savez(path, x=rng.standard_normal((1, 16, 32)).astype(np.float32), y=np.array([3]))
    return path


def test_emulate_trains_the_encoder_in_row_tiles_equal_to_torch_sgd(batch, tmp_path):
    """`poet-opt emulate` with --strips 2: two row blocks of 8 tokens; the weights after one step
    equal torch.optim.SGD's within 1e-4 of the largest weight."""
    weights = tmp_path / "w.npz"
    result = cli("emulate", "--torch", SPEC, "--input-shape", "1,16,32", "--device", "nrf52840", "--ram", "12KiB",
                 "--strips", "2", "--steps", "1", "--lr", LR, "--data", batch, "--weights-out", weights, "--json",
                 "--time-limit", "5", "-q")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["weights"] == "streamed" and summary["rows"]["blocks"] == 2
    assert summary["ram_used_bytes"] <= summary["ram_device_bytes"]
    with np.load(weights) as got:
        largest, worst = worst_against_sgd(small_encoder_classifier, batch, dict(got))
    assert worst <= 1e-4 * largest, worst


@pytest.mark.parametrize("program", [False, True])
def test_features_in_pieces_and_heads_across_them_train_equal_to_torch_sgd(batch, program):
    """Tiles fit to 3 KiB cut the 32 features into 4 pieces of 8: each head (16 features) spans two
    pieces, each linear layer is 16 tiles and each token's layer-norm statistics chain over 4; as
    straight-line C and as a step program (firmware/program.py), which a large plan's step becomes."""
    result = emulate_rows(small_encoder_classifier, batch, tile_budget=3 * 1024, program=program)
    assert [tuple(c) for c in result.network.graph.meta["rows"].cols["q"]] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    largest, worst = worst_against_sgd(small_encoder_classifier, batch, result.weights)
    assert worst <= 1e-4 * largest, worst


def test_an_operator_without_a_row_kernel_is_refused_before_solving_naming_strips(batch, tmp_path):
    """tanh runs in `poet-opt run`'s row tiles (the executor), not in the firmware's: emulate says so
    in one line, naming the node and --strips, before anything is solved."""
    model = tmp_path / "block.py"
    model.write_text("from torch import nn\n\nfrom poet_opt.examples.torch_models import EncoderClassifier\n\n\n"
                     "def factory():\n    m = EncoderClassifier(d=32, h=2, ff=64, classes=4)\n"
                     "    m.act = nn.Tanh()\n    return m\n")
    result = cli("emulate", "--torch", f"{model}:factory", "--input-shape", "1,16,32", "--device", "nrf52840",
                 "--ram", "12KiB", "--strips", "2", "--steps", "1", "--lr", LR, "--data", batch, "-q")
    assert_one_line_error(result, "--strips", "'act' (tanh)", "no row-tile kernel")


def test_emulate_says_a_transformer_fits_only_in_row_tiles_when_they_are_turned_off(batch):
    big = batch.with_name("big.npz")  # 32 tokens: more than the mkr1000 holds whole
    np.savez(big, x=np.zeros((1, 32, 32), np.float32), y=np.array([3]))
    result = cli("emulate", "--torch", SPEC, "--input-shape", "1,32,32", "--device", "mkr1000", "--ram", "16KiB",
                 "--strips", "off", "--steps", "1", "--lr", LR, "--data", big, "-q")
    assert_one_line_error(result, "--strips", "row tiles")


def test_a_transformer_that_fits_whole_but_has_views_the_firmware_cannot_move_is_pointed_to_strips(batch):
    """Whole, the block's head split is a transposing view no kernel runs; in row tiles the maths is
    the row operators'. Defaults fit it whole on the nRF52840, so the refusal says --strips N."""
    result = cli("emulate", "--torch", SPEC, "--input-shape", "1,16,32", "--device", "nrf52840", "--ram", "200KiB",
                 "--steps", "1", "--lr", LR, "--data", batch, "-q")
    assert_one_line_error(result, "--strips", "transpose", "give --strips N")
