"""The firmware runs row-tile plans (issue 27, item 5): a transformer written out in PyTorch, its
tokens in row blocks and its features in pieces (model/rows.py), trains on the emulated core as one
torch.optim.SGD step does (firmware/row_codegen.py); what it has no row kernel for is refused
before solving, naming the option; the library's predict on a row plan gives PyTorch's logits. The
full-size encoder block of the issue at 200 KiB is in benchmarks/FIRMWARE.md ("Row tiles"):
minutes, too long for the suite."""

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
    """sigmoid runs in `poet-opt run`'s row tiles (the executor), not in the firmware's (it has no C
    kernels; tanh, which this test used before, has them now): emulate says so in one line, naming
    the node and --strips, before anything is solved."""
    model = tmp_path / "block.py"
    model.write_text("from torch import nn\n\nfrom poet_opt.examples.torch_models import EncoderClassifier\n\n\n"
                     "def factory():\n    m = EncoderClassifier(d=32, h=2, ff=64, classes=4)\n"
                     "    m.act = nn.Sigmoid()\n    return m\n")
    result = cli("emulate", "--torch", f"{model}:factory", "--input-shape", "1,16,32", "--device", "nrf52840",
                 "--ram", "12KiB", "--strips", "2", "--steps", "1", "--lr", LR, "--data", batch, "-q")
    assert_one_line_error(result, "--strips", "'act' (sigmoid)", "no row-tile kernel")


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


def test_predict_on_a_row_plan_of_four_blocks_gives_torch_s_logits_before_and_after_a_step():
    """The library's ``predict`` on a row plan, as the data-set harness calls it for --eval: a block
    with four times the tokens and twice the features of the ones above (64 tokens of 64, 4 heads,
    FFN 128), its tokens in 4 row blocks. On two eval samples it gives PyTorch's logits for the fresh
    module, then, after one training step, for the module after one torch.optim.SGD step; the
    weights are SGD's too."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.examples.torch_models import EncoderClassifier
    from poet_opt.firmware.dataset import Feeder
    from poet_opt.firmware.fit import solve_for_export
    from poet_opt.firmware.row_codegen import check_rows
    from poet_opt.firmware.trainer import run_schedule
    from poet_opt.model.network import lower_network

    def factory():
        torch.manual_seed(0)
        return EncoderClassifier(d=64, h=4, ff=128, classes=5)

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((1, 64, 64)).astype(np.float32), np.array([3])
    eval_x, eval_y = rng.standard_normal((2, 64, 64)).astype(np.float32), np.array([1, 4])
    # at 64 KiB the tiles keep the 64 features whole (the pieces are the tests' above): a plan of
    # 288 nodes, which the arena places in seconds
    network = lower_network(factory(), x.shape, weights="streamed", strips=4, strip_budget=64 * 1024)
    check_rows(network)
    assert [tuple(b) for b in network.graph.meta["rows"].blocks] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    profile = load_profile("nrf52840")
    plan = solve_for_export(network.graph, profile, ram=200 * 1024, time_limit=5)
    feed = Feeder(x, y, 1, 1, 0, eval_x, eval_y)
    result = run_schedule(network, plan, profile, steps=1, lr=LR, x=x, y=y, feed=feed)

    module = factory()
    with torch.no_grad():
        before = module(torch.from_numpy(eval_x)).numpy()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    opt.step()
    with torch.no_grad():
        after = module(torch.from_numpy(eval_x)).numpy()
    for phase, want in (("before", before), ("after", after)):
        got = np.concatenate(feed.predictions[phase])
        assert got.shape == want.shape == (2, 5)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), phase
    assert not np.allclose(before, after)  # the step moved the logits predict gives
    reference = {n: p.detach().numpy() for n, p in module.named_parameters()}
    largest = max(float(np.abs(w).max()) for w in reference.values())
    assert max(float(np.abs(result.weights[n] - w).max()) for n, w in reference.items()) <= 1e-4 * largest
