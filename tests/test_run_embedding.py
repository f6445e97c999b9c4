"""`poet-opt run` trains a model that starts with an embedding of token ids (issue 27, "every plan
runs"): --data's x holds integer ids, the executor gathers table rows with torch's own embedding
and its gradient reaches the table; one step equals torch.optim.SGD's on the module. A batch
that does not fit the model's input (floats for ids, ids outside the table, ids for a model of
features) is refused in one line naming --data."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from test_cli import assert_one_line_error, cli  # noqa: E402

from poet_opt.examples.torch_models import small_token_classifier  # noqa: E402

SPEC = "poet_opt.examples.torch_models:small_token_classifier"
LR = 0.05


def bag_of_words():
    """A table of 100 words, flattened into a linear head: every layer whole, resident."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Flatten(), torch.nn.Linear(16 * 8, 4))


BAG = f"{__file__}:bag_of_words"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ids(tmp_path, shape=(2, 16), vocab=100, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    path = tmp_path / "ids.npz"
    np.savez(path, x=rng.integers(0, vocab, shape), y=rng.integers(0, classes, shape[0]))
    return path


def against_sgd(factory, data, trained: dict, steps: int = 1) -> tuple[float, float, float]:
    """(largest weight, largest difference, largest change of the word table) of
    ``trained`` against ``steps`` torch.optim.SGD steps of a fresh ``factory()`` on ``data``."""
    module = factory()
    start = {n: p.detach().clone().numpy() for n, p in module.named_parameters()}
    with np.load(data) as d:
        x, y = torch.from_numpy(d["x"]).long(), torch.from_numpy(d["y"])
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        opt.step()
    want = {n: p.detach().numpy() for n, p in module.named_parameters()}
    assert set(trained) == set(want)
    largest = max(float(np.abs(w).max()) for w in want.values())
    worst = max(float(np.abs(trained[n] - w).max()) for n, w in want.items())
    table = next(f"{n}.weight" for n, m in module.named_modules() if isinstance(m, torch.nn.Embedding))  # the words
    moved = float(np.abs(trained[table] - start[table]).max())
    return largest, worst, moved


@pytest.mark.parametrize("weights", ["resident", "streamed"])
def test_run_trains_an_embedding_of_token_ids_as_torch_sgd(weights, tmp_path):
    """Whole layers: resident, torch's own embedding forward and its table's gradient by autograd;
    streamed, the strip replay's (executor/strips.py: F.embedding, each token's gradient added into
    its row), the table read from storage and written back after its update, as emulate does."""
    data, out = _ids(tmp_path), tmp_path / "after.npz"
    ran = cli("run", "--torch", BAG, "--input-shape", "2,16", "--device", "rpi4", "--ram", "1MiB",
              "--weights", weights, "--steps", "2", "--lr", LR, "--data", data, "--weights-out", out, "--json",
              "--time-limit", "10")
    assert ran.exit_code == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["weights"] == weights
    assert summary["peak_live_bytes"] == summary["planned_peak_bytes"]
    with np.load(out) as trained:
        largest, worst, moved = against_sgd(bag_of_words, data, dict(trained), steps=2)
    assert worst <= 1e-5 * largest, worst
    assert moved > 1e-4  # the gradient reached the table: the rows of the ids seen moved


def small_bert():
    """bert-base's twin (model/zoo_twins.py: word and position tables, post-LN blocks, a pooler on
    the [CLS] token, a 2-class head) at toy sizes: what tests can run of it in seconds. Its position
    table has 130 rows for 16 tokens, so that a tile of it lies past the sequence, as bert-base's
    (no node reads it; the trained table keeps its rows as they were)."""
    from poet_opt.model.zoo_twins import bert

    torch.manual_seed(0)
    return bert(d=32, heads=2, d_ff=64, layers=2, vocab=200, positions=128)


@pytest.mark.parametrize("factory, spec, vocab, classes", [
    (small_token_classifier, SPEC, 100, 4),
    (small_bert, f"{__file__}:small_bert", 200, 2),
])
def test_run_trains_embeddings_in_row_tiles_as_torch_sgd_at_the_plan_s_peak(factory, spec, vocab, classes, tmp_path):
    """Streamed weights, tokens in row blocks (model/torch_rows.py): the tables are cut into tiles
    of vocabulary rows, each token's rows gathered tile by tile and updated sparsely; a position
    table is indexed by position, the pooler reads [CLS] only. Two steps equal torch.optim.SGD's
    within 1e-5 of the largest weight, every table moved, at the plan's peak of live bytes."""
    data, out = _ids(tmp_path, (1, 16), vocab=vocab, classes=classes), tmp_path / "after.npz"
    ran = cli("run", "--torch", spec, "--input-shape", "1,16", "--device", "nrf52840", "--ram", "48KiB",
              "--weights", "streamed", "--strips", "2", "--steps", "2", "--lr", LR, "--data", data,
              "--weights-out", out, "--json", "--time-limit", "3")
    assert ran.exit_code == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["weights"] == "streamed" and summary["peak_live_bytes"] == summary["planned_peak_bytes"]
    with np.load(out) as trained:
        trained = dict(trained)
    largest, worst, moved = against_sgd(factory, data, trained, steps=2)
    assert worst <= 1e-5 * largest, worst
    assert moved > 1e-4
    start = factory().state_dict()
    tables = [n for n, p in factory().named_parameters() if "position" in n or "word" in n or "embed" in n]
    assert all(float(np.abs(trained[n] - start[n].numpy()).max()) > 0 for n in tables), tables


def test_the_commands_of_docs_executor_md_on_token_ids_run(tmp_path, monkeypatch):
    """The sh block of docs/executor.md's "Token ids", line by line in a scratch directory: the
    plan's peak and bytes held, two steps equal to torch.optim.SGD's on the module."""
    from test_run_tiles import run_executor_md_section, torch_sgd

    _, summary = run_executor_md_section("## Token ids", tmp_path, monkeypatch)
    assert summary["peak_live_bytes"] == summary["planned_peak_bytes"] <= 16 * 1024
    assert summary["storage_bytes_read"] == summary["planned_storage_bytes_read"] > 0
    losses, _ = torch_sgd(small_token_classifier(), tmp_path / "ids_batch.npz", 2, LR)
    assert summary["loss"] == pytest.approx(losses, rel=1e-5)


def test_paged_token_ids_come_back_as_the_same_ids(tmp_path):
    """A plan may page out a block of token ids (bert-base's does): the file holds their int32
    bits, and they come back as the same integers, not as floats of those bits."""
    from poet_opt.executor.runner import Storage
    from poet_opt.executor.tiled import _flatten, _unflatten

    ids = torch.tensor([[0, 1, 30521, 2 ** 31 - 1]], dtype=torch.int32)
    value = (ids, {"stats": torch.tensor([0.5, -2.0])}, 3)
    flat, layout = _flatten(value)
    store = Storage(tmp_path)
    try:
        store.write(7, flat)
        back = _unflatten(store.read(7, (flat.numel(),), torch.device("cpu")), layout)
    finally:
        store.close()
    assert back[0].dtype == torch.int32 and torch.equal(back[0], ids)
    assert torch.equal(back[1]["stats"], value[1]["stats"]) and back[2] == 3


def test_floats_for_a_row_tiled_model_of_token_ids_are_refused_before_its_rows_are_built(tmp_path, monkeypatch):
    """bert-base's row graph takes a minute to build: a batch of floats is refused as soon as the
    module is traced, in one line naming --data, not after the rows."""
    from poet_opt.executor import train

    def no_rows(*args, **kwargs):
        raise AssertionError("the rows were built before the batch was checked")

    monkeypatch.setattr(train, "_row_network", no_rows)
    data = tmp_path / "floats.npz"
    np.savez(data, x=np.zeros((1, 16), np.float32), y=np.array([0]))
    ran = cli("run", "--torch", f"{__file__}:small_bert", "--input-shape", "1,16", "--device", "nrf52840", "--ram",
              "48KiB", "--weights", "streamed", "--strips", "2", "--steps", "1", "--lr", LR, "--data", data)
    assert_one_line_error(ran, "--data", "float32", "token ids into an embedding of 200 rows")


def max_norm_table():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(100, 8, max_norm=1.0), torch.nn.Flatten(), torch.nn.Linear(128, 4))


def padded_token_classifier():
    module = small_token_classifier()
    module.embed.padding_idx = 0
    return module


@pytest.mark.parametrize("factory, args, field, why", [
    ("max_norm_table", ["--weights", "resident"], "--torch", "max_norm"),
    ("padded_token_classifier", ["--weights", "streamed", "--strips", "2", "--ram", "48KiB"], "--strips", "padding_idx"),
])
def test_tables_the_executor_would_not_train_as_torch_are_refused_in_one_line(factory, args, field, why, tmp_path):
    """max_norm renormalises the table in place in the forward; a padding row's gradient is zero
    in torch, which the row tiles' sparse update does not know of: refused, naming the option."""
    data = _ids(tmp_path, (1, 16))
    ran = cli("run", "--torch", f"{__file__}:{factory}", "--input-shape", "1,16", "--device", "nrf52840",
              *(args if "--ram" in args else [*args, "--ram", "200KiB"]), "--steps", "1", "--lr", LR, "--data", data)
    assert_one_line_error(ran, field, why, "nn.Embedding")
