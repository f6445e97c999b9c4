"""Row tiles of a transformer given with --torch, planned by `solve` and run by `poet-opt run`
(issue 27, items 2, 4, 5).

The hand-written encoder block of examples/torch_models.py (linear Q, K, V split into heads by view
and transpose, softmax attention by matmul, residual adds, layer norms, a GELU feed-forward, a mean
over tokens and a head), small: d 32, 2 heads, FFN 64, 32 tokens. On the 32 KiB MKR1000 its
attention scores alone do not fit whole, so `solve` and `run`, with their defaults, both tile its
tokens into row blocks; `run` executes the plan step for step and must train exactly as plain
PyTorch, at the plan's peak, moving the plan's bytes. The full-size block (d 256, 64 tokens) at
200 KiB on the nRF52840 is benchmarks/RUN_TILES.md ("Row tiles")."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

from test_cli import assert_one_line_error, cli  # noqa: E402

from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import EncoderClassifier, small_encoder_classifier  # noqa: E402
from poet_opt.executor.train import lower_for_run  # noqa: E402
from poet_opt.model.load import default_tile_bytes, load_training_graph  # noqa: E402
from poet_opt.model.network import lower_network  # noqa: E402

SPEC = "poet_opt.examples.torch_models:small_encoder_classifier"
SHAPE = "1,32,32"
MKR = dict(device_ram_bytes=32768, stack_reserve_bytes=4096)  # hardware_profiles/mkr1000.yaml
RAM = 16 * 1024
LR = 0.05

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def batch(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "batch.npz"
    np.savez(path, x=rng.standard_normal((1, 32, 32)).astype(np.float32), y=np.array([3]))
    return path


def _graph_shape(graph):
    return sorted((n.name, n.kind, n.bytes, n.op, tuple(sorted(graph.nodes[d].name for d in n.deps)),
                   tuple(graph.nodes[p].name for p in n.updates), n.writes_bytes) for n in graph.nodes)


def test_solve_and_run_tile_the_block_s_tokens_alike_by_default():
    """Defaults only (weights auto, strips auto): the block's weights stream and its tokens go into
    row blocks in both, with the same nodes, sizes and inputs, every node within --ram."""
    solved, _ = load_training_graph(torch=SPEC, input_shape=SHAPE, weights="auto", ram_bytes=RAM,
                                    tile_bytes=default_tile_bytes([RAM]), **MKR)
    network = lower_for_run(SPEC, SHAPE, ram_bytes=RAM, **MKR)
    assert solved.streams_weights and len(solved.meta["rows"].blocks) >= 2
    assert _graph_shape(network.graph) == _graph_shape(solved)
    assert network.graph.largest_working_set()[0] <= RAM


def test_run_trains_a_row_plan_as_pytorch_with_the_plan_s_peak(batch, tmp_path):
    """solve --out, then run --schedule: two SGD steps equal torch's within 1e-5 of the largest
    weight, the measured peak of live tensors is the plan's, and the storage traffic is the plan's
    page-outs, page-ins, tile reads and write-backs, byte for byte."""
    plan, out = tmp_path / "plan.json", tmp_path / "after.npz"
    common = ["--torch", SPEC, "--input-shape", SHAPE]
    solved = cli("solve", *common, "--device", "mkr1000", "--ram", "16KiB", "--time-limit", "5", "-q", "--out", plan)
    assert solved.exit_code == 0, solved.stderr
    doc = json.loads(plan.read_text())
    names = [n["name"] for n in doc["graph"]["nodes"]]
    assert any("@r1@" in n for n in names) and any(n.startswith("param:fc1#") for n in names)
    ran = cli("run", *common, "--schedule", plan, "--steps", "2", "--lr", LR, "--data", batch, "--weights-out", out,
              "--storage", tmp_path / "card", "--json")
    assert ran.exit_code == 0, ran.stderr
    summary = json.loads(ran.stdout)
    assert summary["weights"] == "streamed"
    assert summary["peak_live_bytes"] == summary["planned_peak_bytes"] == doc["totals"]["peak_ram_bytes"]
    assert summary["storage_bytes_written"] == summary["planned_storage_bytes_written"] > 0
    assert summary["storage_bytes_read"] == summary["planned_storage_bytes_read"] > 0
    module = small_encoder_classifier()
    with np.load(batch) as b:
        x, y = torch.from_numpy(b["x"]), torch.from_numpy(b["y"])
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert summary["loss"] == pytest.approx(losses, rel=1e-5)
    reference = {n: p.detach().numpy() for n, p in module.named_parameters()}
    with np.load(out) as trained:
        assert set(trained.files) == set(reference)
        scale = max(float(np.abs(v).max()) for v in reference.values())
        worst = max(float(np.abs(trained[n] - reference[n]).max()) for n in reference)
        start = small_encoder_classifier().state_dict()
        # K's bias shifts all of a query's scores alike, which softmax ignores: its gradient is zero
        moved = min(float(np.abs(trained[n] - start[n].numpy()).max()) for n in reference if n != "k.bias")
    assert worst <= 1e-5 * scale, worst
    assert moved > 0  # every other parameter was trained, none left as it started
    assert not any((tmp_path / "card").iterdir())


class _Scaled(EncoderClassifier):
    """The block with its scores scaled otherwise: multiplied by a constant, or not at all."""

    def __init__(self, scale):
        super().__init__(d=16, h=2, ff=32, classes=3)
        self.scale = scale

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = ((m(x).view(b, s, self.h, d // self.h).transpose(1, 2)) for m in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1)
        a = torch.softmax(scores * self.scale if self.scale is not None else scores, dim=-1)
        x = self.ln1(x + self.o((a @ v).transpose(1, 2).reshape(b, s, d)))
        x = self.ln2(x + self.fc2(self.act(self.fc1(x))))
        return self.head(x.mean(dim=1))


@pytest.mark.parametrize("scale", [0.3, None])
def test_the_row_graph_keeps_the_module_s_own_scaling(scale):
    """The row replay of the lowered module (three row blocks) equals autograd and SGD on it."""
    import copy

    from poet_opt.executor.rows import replay

    torch.manual_seed(1)
    module = _Scaled(scale)
    reference = copy.deepcopy(module)
    network = lower_network(module, (1, 9, 16), weights="streamed", strips=3, strip_budget=10 ** 9)
    assert len(network.graph.meta["rows"].blocks) == 3
    params = {name: {r: torch.tensor(p.value) for r, p in layer.params.items()}
              for name, layer in network.layers.items() if layer.params}
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(1, 9, 16, generator=gen), torch.tensor([2])
    replay(network.graph, params, x, y, LR)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    F.cross_entropy(reference(x), y).backward()
    opt.step()
    want = dict(reference.named_parameters())
    for name, layer in network.layers.items():
        for role, p in layer.params.items():
            assert torch.allclose(params[name][role], want[p.torch_name].detach(), rtol=0, atol=1e-6), (name, role)


class _WrongHeads(EncoderClassifier):
    """Shapes a row graph would accept, maths it does not compute: heads taken as (h, s, dh) blocks
    of memory rather than feature slices, or the tokens summed rather than averaged."""

    def __init__(self, fault):
        super().__init__(d=16, h=2, ff=32, classes=3)
        self.fault = fault

    def forward(self, x):
        b, s, d = x.shape
        split = (lambda t: t.view(b, self.h, s, d // self.h)) if self.fault == "heads" else \
            (lambda t: t.view(b, s, self.h, d // self.h).transpose(1, 2))
        q, k, v = (split(m(x)) for m in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-2, -1) / 8.0, dim=-1)
        x = self.ln1(x + self.o((a @ v).transpose(1, 2).reshape(b, s, d)))
        x = self.ln2(x + self.fc2(self.act(self.fc1(x))))
        return self.head(x.sum(dim=1) if self.fault == "sum" else x.mean(dim=1))


@pytest.mark.parametrize("fault, node, what", [("heads", "matmul", "not Q split into heads"),
                                               ("sum", "sum", "not a mean over the tokens")])
def test_the_row_lowering_refuses_what_it_cannot_see_through_naming_the_node(fault, node, what):
    with pytest.raises(PoetError) as err:
        lower_network(_WrongHeads(fault), (1, 8, 16), weights="streamed", strips="auto", strip_budget=4096)
    assert err.value.field == "--strips"
    assert f"node {node!r}" in str(err.value) and what in str(err.value)


def test_run_tiles_a_streamed_transformer_no_backend_streams_whole(batch):
    """The small block fits the nRF52840 whole, but its attention is written with transposing views
    that only row tiles see through, and the executor streams a transformer's weights only in row
    tiles: no backend streams it whole, so auto tiles its tokens, in every command alike
    (tests/test_same_lowering.py); --strips N asks for N blocks."""
    common = ["run", "--torch", SPEC, "--input-shape", SHAPE, "--device", "nrf52840", "--ram", "64KiB",
              "--weights", "streamed", "--steps", "1", "--lr", LR, "--data", batch, "--time-limit", "5", "--json"]
    for extra in ([], ["--strips", "2"]):
        ran = cli(*common, *extra)
        assert ran.exit_code == 0, ran.stderr
        summary = json.loads(ran.stdout)
        assert summary["peak_live_bytes"] == summary["planned_peak_bytes"] <= 64 * 1024


class ProductChain(torch.nn.Module):
    """Two projections multiplied, with no view between them: a transformer's products that the
    firmware runs whole (test_support_matrix.py's chain of token operators)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.ln = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.LayerNorm(6)
        self.sm, self.head = torch.nn.Softmax(-1), torch.nn.Linear(36, 3)

    def forward(self, x):
        x = self.ln(x)
        return self.head(torch.flatten(self.sm(torch.matmul(self.q(x), self.k(x))), 1))


def product_chain():
    torch.manual_seed(12)
    return ProductChain()


def test_run_refuses_to_stream_whole_what_only_the_firmware_streams_whole_naming_strips(tmp_path):
    """The chain fits whole and the firmware streams it whole (`emulate` trains that plan), but the
    executor streams a transformer's weights only in row tiles: one line naming --strips."""
    data = tmp_path / "chain.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((1, 6, 6)).astype(np.float32), y=np.array([1]))
    ran = cli("run", "--torch", f"{__file__}:product_chain", "--input-shape", "1,6,6", "--device", "nrf52840",
              "--ram", "64KiB", "--weights", "streamed", "--steps", "1", "--lr", LR, "--data", data)
    assert_one_line_error(ran, "--strips", "only in row tiles", "--strips N")


def test_the_commands_of_docs_executor_md_on_row_tiles_run(tmp_path, monkeypatch):
    """The sh block of docs/executor.md's "Row tiles of a transformer", line by line in a scratch
    directory, and what the text around it says of the result."""
    from test_run_tiles import run_executor_md_section, torch_sgd

    section, summary = run_executor_md_section("## Row tiles of a transformer", tmp_path, monkeypatch)
    plan = json.loads((tmp_path / "rows_plan.json").read_text())
    names = [n["name"] for n in plan["graph"]["nodes"]]
    assert "The plan has 128 nodes (2 row blocks of 16 tokens)" in section and len(names) == 128
    assert any("@r1@" in n for n in names) and not any("@r2@" in n for n in names)
    assert summary["peak_live_bytes"] == summary["planned_peak_bytes"] <= 16 * 1024
    assert summary["storage_bytes_read"] == summary["planned_storage_bytes_read"] > 0
    losses, _ = torch_sgd(small_encoder_classifier(), tmp_path / "rows_batch.npz", 2, LR)
    assert summary["loss"] == pytest.approx(losses, rel=1e-5)


def test_frozen_layers_of_a_row_plan_stay_and_the_trained_ones_step_as_sgd():
    """--trainable last:2 in two row blocks: only the last norm and the head are trained (no gradient
    flows into attention), equal to SGD on those parameters alone, at the plan's peak."""
    from poet_opt.executor.tiled import TiledExecutor
    from poet_opt.solver.driver import solve

    network = lower_for_run(SPEC, SHAPE, trainable="last:2", strips=2, ram_bytes=RAM, **MKR)
    assert [n for n, layer in network.layers.items() if layer.trainable] == ["ln2", "head"]
    assert not any(n.name.startswith("grad:matmul") for n in network.graph.nodes)
    plan = solve(network.graph, "mkr1000", ram=RAM, time_limit=5)
    rng = np.random.default_rng(0)
    x, y = torch.from_numpy(rng.standard_normal((1, 32, 32)).astype(np.float32)), torch.tensor([3])
    with TiledExecutor(network, plan, lr=LR) as step:
        step(x, y)
        trained = step.weights()
        assert step.last.peak_live_bytes == step.planned_peak_bytes
    module = small_encoder_classifier()
    opt = torch.optim.SGD([p for n, p in module.named_parameters() if n.startswith(("ln2.", "head."))], lr=LR)
    F.cross_entropy(module(x), y).backward()
    opt.step()
    want = {n: p.detach().numpy() for n, p in module.named_parameters()}
    assert sorted(trained) == ["head.bias", "head.weight", "ln2.bias", "ln2.weight"]
    assert max(float(np.abs(trained[n] - want[n]).max()) for n in trained) <= 1e-5 * max(
        float(np.abs(v).max()) for v in want.values())
