"""`poet-opt emulate` trains models of token ids (issue 27): the firmware's embedding kernels gather
table rows by int32 id and update the rows of the ids seen, whole (resident or streamed) and in
row tiles (tables cut into tiles of vocabulary rows; a position table indexed by position), and
the step on the emulated core equals one torch.optim.SGD step on the module. A batch that does
not fit the model's input is refused as `run` refuses it (model/batch.py's check_x): one line
naming --data, exit 2. The library's own main() on token ids and `measure` are
tests/test_token_ids_firmware.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_cli import assert_one_line_error, cli  # noqa: E402
from test_emulate_defaults import assert_trained_like_torch  # noqa: E402
from test_run_embedding import BAG, LR, _ids, bag_of_words, small_bert  # noqa: E402

from poet_opt.examples.torch_models import small_token_classifier  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tables_moved(factory, trained_file) -> None:
    """Every table's rows of the ids seen moved: the gradient reached it."""
    start = factory()
    with np.load(trained_file) as trained:
        for name, m in start.named_modules():
            if isinstance(m, torch.nn.Embedding):
                assert float(np.abs(trained[f"{name}.weight"] - m.weight.detach().numpy()).max()) > 1e-4, name


@pytest.mark.parametrize("weights", ["resident", "streamed"])
def test_emulate_trains_an_embedding_of_token_ids_as_torch_sgd(weights, tmp_path):
    """Whole layers: the ids in the input's arena slot, the table's rows gathered by
    poet_embedding_forward; resident, its gradient then poet_sgd_step; streamed, the fused SGD
    on the table read into the arena and written back. The library takes int32 ids."""
    data, out = _ids(tmp_path), tmp_path / "after.npz"
    ran = cli("emulate", "--torch", BAG, "--input-shape", "2,16", "--device", "nrf52840", "--ram", "64KiB",
              "--weights", weights, "--steps", "2", "--lr", LR, "--data", data, "--weights-out", out, "--json",
              "--time-limit", "10", "-o", tmp_path / "fw")
    assert ran.exit_code == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary.get("weights", "resident") == weights
    assert_trained_like_torch(out, summary, bag_of_words(), data, steps=2, lr=LR)
    _tables_moved(bag_of_words, out)
    header = (tmp_path / "fw" / "poet_train.h").read_text()
    assert "const int32_t *inputs" in header and "#define POET_INPUT_IDS 32u" in header
    assert "#define POET_VOCABULARY 100u" in header and "POET_INPUT_FLOATS" not in header


@pytest.mark.parametrize("factory, spec, vocab, classes", [
    (small_token_classifier, "poet_opt.examples.torch_models:small_token_classifier", 100, 4),
    (small_bert, "tests/test_run_embedding.py:small_bert", 200, 2),
])
def test_emulate_trains_embeddings_in_row_tiles_as_torch_sgd(factory, spec, vocab, classes, tmp_path):
    """Row tiles (model/torch_rows.py), as `run` trains them in test_run_embedding.py: the tables
    cut into tiles of vocabulary rows, each block's rows gathered tile by tile and each tile's rows
    updated from the blocks that read it; the reduced BERT twin's position table is indexed by
    position (its tiles past the 16 tokens never read, its rows there unchanged), its pooler reads
    [CLS] through tanh. Two steps equal torch.optim.SGD's."""
    from pathlib import Path

    spec = spec if not spec.startswith("tests/") else str(Path(__file__).resolve().parent / spec[len("tests/"):])
    data, out = _ids(tmp_path, (1, 16), vocab=vocab, classes=classes), tmp_path / "after.npz"
    ran = cli("emulate", "--torch", spec, "--input-shape", "1,16", "--device", "nrf52840", "--ram", "48KiB",
              "--weights", "streamed", "--strips", "2", "--steps", "2", "--lr", LR, "--data", data,
              "--weights-out", out, "--json", "--time-limit", "10")
    assert ran.exit_code == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["rows"]["blocks"] == 2
    assert_trained_like_torch(out, summary, factory(), data, steps=2, lr=LR)
    _tables_moved(factory, out)
    if factory is small_bert:  # 130 position rows, 16 tokens: the rows past them are as they started
        with np.load(out) as trained:
            table = trained["embeddings.position_type.weight"]
        start = factory().embeddings.position_type.weight.detach().numpy()
        assert np.array_equal(table[64:], start[64:])


@pytest.mark.parametrize("fault, needle", [
    ("float", "expected integers"),
    ("outside", "must lie in [0, 100)"),
    ("negative", "must lie in [0, 100)"),
])
def test_a_batch_of_other_than_the_table_s_token_ids_is_refused_as_run_refuses_it(fault, needle, tmp_path):
    """The same check and the same line as `run` (test_run_embedding.py), before anything is solved."""
    rng = np.random.default_rng(1)
    x = {"float": rng.standard_normal((2, 16)).astype(np.float32),
         "outside": np.full((2, 16), 100, np.int64),
         "negative": np.full((2, 16), -1, np.int32)}[fault]
    data = tmp_path / "bad.npz"
    np.savez(data, x=x, y=np.array([0, 1]))
    for command in ("emulate", "run"):
        ran = cli(command, "--torch", BAG, "--input-shape", "2,16", "--device", "nrf52840", "--ram", "64KiB",
                  "--steps", "1", "--lr", LR, "--data", data)
        assert_one_line_error(ran, "--data", needle)


def test_token_ids_for_a_model_of_features_are_refused_in_one_line(tmp_path):
    data = tmp_path / "ids.npz"
    np.savez(data, x=np.zeros((1, 784), np.int64), y=np.array([0]))
    for command in ("emulate", "run"):  # the same line from both (run's own data tests: test_run_embedding.py)
        ran = cli(command, "--model", "mlp", "--device", "nrf52840", "--ram", "200KiB", "--steps", "1", "--lr", LR,
                  "--data", data)
        assert_one_line_error(ran, "--data", "int64", "expected float32", "not token ids")


def test_an_eval_set_of_floats_for_a_model_of_token_ids_names_eval(tmp_path):
    data, bad = _ids(tmp_path, (4, 16)), tmp_path / "eval.npz"
    np.savez(bad, x=np.zeros((2, 16), np.float32), y=np.array([0, 1]))
    ran = cli("emulate", "--torch", BAG, "--input-shape", "2,16", "--device", "nrf52840", "--ram", "64KiB",
              "--steps", "1", "--lr", LR, "--data", data, "--eval", bad)
    assert_one_line_error(ran, "--eval", "expected integers")


@pytest.mark.parametrize("factory", [small_token_classifier, small_bert])
def test_a_step_program_gathers_the_same_rows(factory, tmp_path):
    """A large step runs as a program of kernel calls (firmware/program.py): the token ids' arena
    pointers and the position table are arguments like any other, and the step equals torch's."""
    from test_support_matrix import emulate_rows, worst_against_sgd

    data = _ids(tmp_path, (1, 16), vocab=100, classes=2)
    ran = emulate_rows(factory, data, tile_budget=48 * 1024, program=True)
    largest, worst = worst_against_sgd(factory, data, ran.weights)
    assert worst <= 1e-4 * largest, worst


def test_the_commands_of_docs_firmware_md_on_token_ids_run(tmp_path):
    """The sh block of docs/firmware.md's "Token ids", line by line as typed in a scratch
    directory: two steps equal torch.optim.SGD's on the module, as the text says."""
    import re
    from pathlib import Path

    from conftest import run_as_typed

    doc = (Path(__file__).resolve().parents[1] / "docs" / "firmware.md").read_text()
    section = doc[doc.index("## Token ids"):]
    commands = [line for line in re.search(r"```sh\n(.*?)```", section, re.S).group(1).splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["python", "poet-opt"]
    done = run_as_typed(commands, tmp_path)
    summary = json.loads(done[-1].stdout)
    assert summary["rows"]["blocks"] == 2
    assert_trained_like_torch(tmp_path / "ids_after.npz", summary, small_token_classifier(), tmp_path / "ids_batch.npz",
                              steps=2, lr=LR)
    print("instructions per step", summary["instructions"] / 2)
