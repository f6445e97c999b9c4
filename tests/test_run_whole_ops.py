"""`poet-opt run` runs every operator of the registry whole (issue 27, "every plan runs"): ELU with
its own alpha, sqrt and rsqrt (backwards from the output, which is all the graph keeps), clip as
torch.clamp, sub, mul and div of activations and constants, 1-d and 3-d convolutions, group and instance norm (their
affine weights trained), log-softmax; and the hand-written encoder block, whose attention scores
are divided by a constant. Each is one step (or a few) against torch.optim.SGD on the same module,
also under plans that free and recompute or page, where a gradient may read only what the graph
keeps for it."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

from test_cli import assert_one_line_error, cli  # noqa: E402

from poet_opt.executor.runner import ScheduleExecutor  # noqa: E402
from poet_opt.executor.train import prepare  # noqa: E402
from poet_opt.solver.driver import solve  # noqa: E402

LR = 0.05

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Mixed(nn.Module):
    """Every operator the executor gained, on (C, H, W) tensors: group norm, ELU (alpha 0.5, module
    and function), affine instance norm with running statistics, sqrt and rsqrt of a positive
    tensor, a product of two activations and a square, a difference, a quotient of activations,
    a division by a constant and of a constant, a constant added, a clamp, a log-softmax head."""

    def __init__(self):
        super().__init__()
        self.pre, self.gn = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.elu = nn.ELU(alpha=0.5)
        self.inorm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.b = nn.Conv2d(4, 4, 1)
        self.pool, self.head, self.out = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 3), nn.LogSoftmax(-1)

    def forward(self, x):
        h = self.inorm(F.elu(self.elu(self.gn(self.pre(x))), alpha=0.3))
        q = torch.sigmoid(self.b(h))  # in (0, 1): sqrt and rsqrt of it are finite
        s, r = torch.sqrt(q), q.rsqrt()
        m = h * s
        den = s + r
        z = (m * m - r) / den + 2.0 / den - h / 4.0 + 1.0
        return self.out(self.head(torch.flatten(self.pool(z.clamp(-3.0, 3.0)), 1)))


class Convs(nn.Module):
    """1-d convolutions over (C, L) (and a 1-d max pooling), reshaped into 3-d ones' (C, D, H, W),
    with a residual each."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(3, 8, 3, padding=1), nn.Conv1d(8, 8, 3, padding=1, groups=2)
        self.c3, self.c4 = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1, bias=False)
        self.head, self.pool = nn.Linear(2 * 8 * 2 * 4, 3), nn.MaxPool1d(3, stride=1, padding=1)

    def forward(self, x):
        h = self.pool(self.c1(x))  # (N, 8, 8)
        h = h + self.c2(h)
        v = self.c3(h.reshape(h.shape[0], 1, 8, 2, 4))
        return self.head(torch.flatten(v + self.c4(v), 1))


def mixed():
    torch.manual_seed(0)
    return Mixed()


def convs():
    torch.manual_seed(1)
    return Convs()


def _batch(shape, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), torch.randint(0, 3, (shape[0],), generator=gen)


def _sgd(module, x, y, steps):
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


CASES = {"mixed": (mixed, (2, 3, 6, 6)), "convs": (convs, (2, 3, 8))}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["none", "remat", "paging"])
def test_a_plan_of_the_new_operators_trains_as_torch_sgd(case, mode):
    factory, shape = CASES[case]
    module = factory()
    reference = copy.deepcopy(module)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    network = prepare(module, shape)
    ops = {layer.op for layer in network.layers.values()}
    if case == "mixed":
        assert {"groupnorm", "elu", "instancenorm", "sqrt", "mul", "sub", "div", "clip", "log_softmax"} <= ops, ops
    else:
        assert {"conv1d", "conv3d", "maxpool"} <= ops, ops
    plain = solve(network.graph, "rpi4", ram=10 ** 12, mode="none")
    if mode == "none":
        schedule = plain
    else:  # a budget below the plain peak: tensors are freed and recomputed, or paged
        need, _ = network.graph.largest_working_set()
        budget = max(need, int(plain.totals["peak_ram_bytes"] * 0.75))
        schedule = solve(network.graph, "rpi4", ram=budget, mode=mode, time_limit=20)
        assert schedule.totals["recomputes" if mode == "remat" else "page_outs"] > 0
    x, y = _batch(shape)
    with ScheduleExecutor(network, schedule, lr=LR, device="cpu") as step:
        losses = [step(x, y) for _ in range(2)]
    want = _sgd(reference, x, y, 2)
    assert np.allclose(losses, want, rtol=1e-5), (losses, want)
    mine = dict(module.named_parameters())
    for n, p in reference.named_parameters():
        assert float((p.detach() - start[n]).abs().max()) > 1e-6, f"{n} did not move: the check would prove nothing"
        assert torch.allclose(mine[n].detach(), p.detach(), rtol=0, atol=1e-5 * max(1.0, float(p.abs().max()))), n
    for n, b in reference.named_buffers():  # the instance norm's running statistics moved once per step
        assert torch.allclose(dict(module.named_buffers())[n], b, atol=1e-6), n


MIXED = f"{__file__}:mixed"


def test_run_trains_the_new_operators_as_torch_sgd(tmp_path):
    """`poet-opt run --torch` end to end: a plan solved for rpi4, one step, the weights written out
    equal torch.optim.SGD's on a fresh module."""
    x, y = _batch((2, 3, 6, 6))
    data, out = tmp_path / "batch.npz", tmp_path / "after.npz"
    np.savez(data, x=x.numpy(), y=y.numpy())
    ran = cli("run", "--torch", MIXED, "--input-shape", "2,3,6,6", "--device", "rpi4", "--ram", "1MiB",
              "--weights", "resident", "--steps", "1", "--lr", LR, "--data", data, "--weights-out", out,
              "--time-limit", "10")
    assert ran.exit_code == 0, ran.stderr
    reference = mixed()
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    _sgd(reference, x, y, 1)
    with np.load(out) as trained:
        trained = dict(trained)
    want = {n: p.detach().numpy() for n, p in reference.named_parameters()}
    assert set(want) <= set(trained)
    for n, w in want.items():
        assert float(np.abs(w - start[n].numpy()).max()) > 1e-6, n
        assert np.allclose(trained[n], w, rtol=0, atol=1e-5 * max(1.0, float(np.abs(w).max()))), n


@pytest.mark.parametrize("factory", ["small_encoder_classifier", "small_token_classifier"])
def test_the_hand_written_encoder_block_runs_whole(factory, tmp_path):
    """The encoder block divides its attention scores by a constant; whole and resident on rpi4 it
    trains as torch.optim.SGD does (its row tiles are tests/test_run_rows.py's)."""
    from poet_opt.examples import torch_models

    tokens = factory == "small_token_classifier"
    shape = (2, 8) if tokens else (2, 8, 32)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 100, shape) if tokens else rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, 4, shape[0])
    data, out = tmp_path / "batch.npz", tmp_path / "after.npz"
    np.savez(data, x=x, y=y)
    ran = cli("run", "--torch", f"poet_opt.examples.torch_models:{factory}", "--input-shape",
              ",".join(map(str, shape)), "--device", "rpi4", "--ram", "64MiB", "--weights", "resident",
              "--strips", "off", "--steps", "1", "--lr", LR, "--data", data, "--weights-out", out, "--json",
              "--time-limit", "10")
    assert ran.exit_code == 0, ran.stderr
    reference = getattr(torch_models, factory)()
    network = prepare(getattr(torch_models, factory)(), shape)
    assert "div" in {layer.op for layer in network.layers.values()}
    _sgd(reference, torch.from_numpy(x), torch.from_numpy(y), 1)
    with np.load(out) as trained:
        trained = dict(trained)
    for n, p in reference.named_parameters():
        w = p.detach().numpy()
        assert np.allclose(trained[n], w, rtol=0, atol=1e-5 * max(1.0, float(np.abs(w).max()))), n


def test_an_operator_the_executor_cannot_run_is_named_in_one_line(tmp_path):
    """Dropout's random mask cannot be replayed by a recompute: refused before solving, naming the node."""
    data = tmp_path / "batch.npz"
    np.savez(data, x=np.zeros((2, 4), np.float32), y=np.array([0, 1]))
    path = tmp_path / "dropout.py"
    path.write_text("import torch\n\ndef model():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4), "
                    "torch.nn.Dropout(), torch.nn.Linear(4, 2))\n")
    ran = cli("run", "--torch", f"{path}:model", "--input-shape", "2,4", "--device", "rpi4", "--ram", "1MiB",
              "--weights", "resident", "--steps", "1", "--lr", LR, "--data", data)
    assert_one_line_error(ran, "--torch", "dropout", "the PyTorch executor has no rule for it")


def test_a_log_softmax_over_another_axis_is_named_in_one_line():
    """Over the batch, not the last axis: refused naming the node (it raised NameError, exit 3)."""
    from poet_opt.errors import PoetError

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LogSoftmax(dim=0))
    with pytest.raises(PoetError, match="node '1': a log-softmax over a dimension other than the last"):
        prepare(module, "2,4")


def test_a_division_by_an_activation_keeps_both_operands():
    """d(a/b)/db = -a/b^2: the graph keeps both operands for the divisor's gradient (a product keeps
    only the other operand, a square its input)."""
    network = prepare(mixed(), (2, 3, 6, 6))
    graph = network.graph
    names = {n.id: n.name for n in graph.nodes}
    div = next(layer for layer in network.layers.values() if layer.op == "div" and len(set(layer.operands)) == 2)
    grad = next(n for n in graph.nodes if n.name == f"grad:{div.operands[1]}")
    assert set(div.operands) <= {names[d] for d in grad.deps}


def test_a_recomputed_instance_norm_leaves_its_running_statistics_alone():
    """The running statistics move at a node's first compute only, as plain training's one forward
    moves them: a recompute gives the same output and leaves them as they were."""
    torch.manual_seed(0)
    norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
    module = nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))
    network = prepare(module, (2, 3, 8, 8))
    kernels = ScheduleExecutor(network, solve(network.graph, "rpi4", ram=10 ** 12, mode="none"), lr=LR,
                               device="cpu").kernels
    x, _ = _batch((2, 3, 8, 8))
    with torch.no_grad():
        table = {"0": module[0](x)}
    start = norm.running_mean.clone()
    first = kernels.forward("1", table, first=True)
    moved = norm.running_mean.clone()
    assert not torch.equal(moved, start)
    again = kernels.forward("1", table, first=False)
    assert torch.equal(norm.running_mean, moved)
    assert torch.allclose(again, first, rtol=0, atol=1e-6)
