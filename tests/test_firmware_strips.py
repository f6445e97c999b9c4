"""Activation strips in firmware: a CNN whose activations do not fit the board's RAM whole trains on
the emulated nRF52840 with them split into strips along H, each node computing its strip from the
strips it reads (halos, chained batch-norm statistics, weight gradients summed link by link), and
ends with the weights of torch.optim.SGD on the unsplit module."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import run_as_typed

torch = pytest.importorskip("torch")
pytest.importorskip("unicorn")
pytest.importorskip("ziglang")

from test_firmware_training import torch_sgd  # noqa: E402

from poet_opt.examples.torch_models import strip_cnn  # noqa: E402
from poet_opt.firmware.trainer import STACK_BYTES  # noqa: E402
from poet_opt.model.network import lower_network  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NRF52840_RAM = 256 * 1024


def _strip_commands() -> list[str]:
    doc = (ROOT / "docs" / "firmware.md").read_text()
    section = doc[doc.index("## Activation strips"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def strip_run(tmp_path_factory):
    """docs/firmware.md's strip commands, as written, in a scratch directory."""
    where = tmp_path_factory.mktemp("strips")
    commands = _strip_commands()
    assert len(commands) == 2 and all(c.startswith(("python", "poet-opt")) for c in commands)
    return where, json.loads(run_as_typed(commands, where, timeout=300)[-1].stdout)


def test_a_cnn_that_fits_only_in_strips_trains_on_the_nrf52840_as_torch_sgd(strip_run):
    where, summary = strip_run
    shape = (1, 1, 96, 96)
    whole = lower_network(strip_cnn(), shape, weights="streamed").graph
    working, node = whole.largest_working_set()
    assert working + STACK_BYTES > NRF52840_RAM, node.name  # unsplit, one node alone exceeds the RAM
    assert summary["strips"] == {"48": 4, "96": 16}
    steps = summary["steps"]
    assert steps >= 2
    module = strip_cnn()
    losses, want = torch_sgd(module, where / "strip-batch.npz", {n for n, _ in module.named_parameters()},
                             steps=steps, lr=0.05)
    with np.load(where / "strip-after.npz") as trained:
        got = {n: trained[n] for n in trained.files}
    # beside the weights, the running statistics the strips' chained statistics moved, as torch's
    running = {n: b.numpy() for n, b in module.named_buffers() if n.endswith(("running_mean", "running_var"))}
    assert running and set(got) == set(want) | set(running)
    for name, value in running.items():
        assert np.abs(got[name] - value).max() <= 1e-4 * max(1.0, float(np.abs(value).max())), name
    largest = max(float(np.abs(w).max()) for w in want.values())
    worst = max(float(np.abs(got[n] - w).max()) for n, w in want.items())
    print(f"\nstrip_cnn: max |firmware - torch| = {worst:.3g} ({worst / largest:.3g} of the largest weight), RAM "
          f"{summary['ram_used_bytes']:,} B (scratch {summary['scratch_bytes']:,} B), "
          f"{summary['instructions'] / steps:,.0f} instructions/step")
    assert worst <= 1e-4 * largest
    assert np.allclose(summary["loss"], losses, rtol=1e-4, atol=1e-6)
    assert summary["ram_used_bytes"] <= NRF52840_RAM == summary["ram_device_bytes"]
    assert 0 < summary["scratch_bytes"] <= 24 * 1024
    # the step runs every kind of strip node: halos, chained statistics, weight-gradient links
    source = (where / "strip-build" / "poet_train.c").read_text()
    for needle in ("compute stats:stem_bn@s15", "poet_batchnorm_strip_stats", "poet_batchnorm_strip_grad_stats",
                   "poet_batchnorm_strip_backward", "compute wgrad:stem@s15", "poet_fill_strided",
                   "poet_maxpool2d_backward", "poet_avgpool2d_backward", "poet_conv2d_backward_input"):
        assert needle in source, needle


def test_emulate_refuses_such_a_cnn_without_strips_or_with_resident_weights(tmp_path):
    from poet_opt.errors import PoetError
    from poet_opt.firmware.trainer import emulate_training

    data = tmp_path / "b.npz"
    np.savez(data, x=np.zeros((1, 1, 96, 96), np.float32), y=np.zeros(1, np.int64))
    spec = "poet_opt.examples.torch_models:strip_cnn"
    common = dict(torch_model=spec, input_shape="1,1,96,96", device="nrf52840", ram="160KiB", steps=1, lr=0.1,
                  data=data)
    with pytest.raises(PoetError, match="needs its activations split into strips") as off:
        emulate_training(**common, weights="streamed", strips="off")
    assert off.value.field == "--ram"
    with pytest.raises(PoetError, match="activation strips need streamed weights") as resident:
        emulate_training(**common, weights="resident")
    assert resident.value.field == "--weights"
    with pytest.raises(PoetError, match="auto, off or a positive whole number"):
        emulate_training(**common, weights="streamed", strips=0)
    # `poet-opt run` trains this plan in PyTorch: tests/test_run_tiles.py


def test_batch_norm_over_uneven_strips_equals_torch_on_the_whole_tensor(tmp_path):
    """The chained statistics (Chan et al.'s merge), the strip forward, the running statistics, the
    chained gradient sums and the strip backward give torch's batch norm of the whole tensor, for an
    offset mean (where a one-pass variance would cancel) and strips of 1, 2 and 4 rows; global
    average pooling summed over strips gives torch's mean."""
    from kernel_host import F, FL, U, Kernels, ptr

    from poet_opt.firmware import toolchain

    k = Kernels(toolchain.compile_host_library(tmp_path / "libpoet_kernels.so"))
    for name, args in {"batchnorm_strip_stats": [F, F, F, U, U, U, U], "batchnorm_strip_forward":
                       [F, F, F, F, F, U, U, U, U, FL], "batchnorm_strip_running": [F, F, F, U, U, FL],
                       "batchnorm_strip_grad_stats": [F, F, F, F, F, U, U, U, U, FL],
                       "batchnorm_strip_backward": [F, F, F, F, F, F, U, U, U, U, FL],
                       "global_avgpool_strip_forward": [F, F, U, U, U],
                       "global_avgpool_strip_backward": [F, F, U, U, U]}.items():
        fn = getattr(k, name)
        fn.restype, fn.argtypes = None, args
    rng = np.random.default_rng(4)
    n, c, h, w, eps, momentum = 2, 3, 7, 5, 1e-5, 0.1
    x = (3.0 + 2.0 * rng.standard_normal((n, c, h, w))).astype(np.float32)
    dy = rng.standard_normal((n, c, h, w)).astype(np.float32)
    gamma, beta = (1 + 0.3 * rng.standard_normal(c)).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tg, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (gamma, beta))
    trm, trv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    ty = torch.nn.functional.batch_norm(tx, trm, trv, tg, tb, training=True, momentum=momentum, eps=eps)
    ty.backward(torch.tensor(dy, dtype=torch.float64))
    bounds = [(0, 1), (1, 3), (3, 7)]
    strip = [np.ascontiguousarray(a[:, :, lo:hi]) for a in (x, dy) for lo, hi in bounds]
    xs, dys = strip[:3], strip[3:]
    total = n * h * w
    stats = [np.zeros(2 * c, np.float32) for _ in bounds]
    for j, (lo, hi) in enumerate(bounds):
        k.batchnorm_strip_stats(ptr(stats[j]), ptr(stats[j - 1]) if j else None, ptr(xs[j]), n, c, (hi - lo) * w,
                                n * lo * w)
    ys, sums = [], [np.zeros(2 * c, np.float32) for _ in bounds]
    for j, (lo, hi) in enumerate(bounds):
        ys.append(np.zeros_like(xs[j]))
        k.batchnorm_strip_forward(ptr(ys[j]), ptr(xs[j]), ptr(stats[-1]), ptr(gamma), ptr(beta), n, c,
                                  (hi - lo) * w, total, eps)
        k.batchnorm_strip_grad_stats(ptr(sums[j]), ptr(sums[j - 1]) if j else None, ptr(dys[j]), ptr(xs[j]),
                                     ptr(stats[-1]), n, c, (hi - lo) * w, total, eps)
    k.batchnorm_strip_running(ptr(rm), ptr(rv), ptr(stats[-1]), c, total, momentum)
    dxs = []
    for j, (lo, hi) in enumerate(bounds):
        dxs.append(np.zeros_like(xs[j]))
        k.batchnorm_strip_backward(ptr(dxs[j]), ptr(dys[j]), ptr(xs[j]), ptr(stats[-1]), ptr(sums[-1]), ptr(gamma),
                                   n, c, (hi - lo) * w, total, eps)

    def close(got, want, what):
        want = want.detach().numpy() if hasattr(want, "detach") else want
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), what

    close(stats[-1][:c], x.astype(np.float64).mean(axis=(0, 2, 3)), "mean")
    close(stats[-1][c:] / total, x.astype(np.float64).var(axis=(0, 2, 3)), "variance")
    close(np.concatenate(ys, axis=2), ty, "forward")
    close(rm, trm, "running mean")
    close(rv, trv, "running variance")
    close(sums[-1][c:], tg.grad, "gamma's gradient")
    close(sums[-1][:c], tb.grad, "beta's gradient")
    close(np.concatenate(dxs, axis=2), tx.grad, "backward")
    pooled = np.zeros(n * c, np.float32)
    grads = [np.zeros_like(s) for s in xs]
    g = rng.standard_normal(n * c).astype(np.float32)
    for j, (lo, hi) in enumerate(bounds):
        k.global_avgpool_strip_forward(ptr(pooled), ptr(xs[j]), n * c, (hi - lo) * w, h * w)
        k.global_avgpool_strip_backward(ptr(grads[j]), ptr(g), n * c, (hi - lo) * w, h * w)
    close(pooled, x.astype(np.float64).mean(axis=(2, 3)).reshape(-1), "global pooling")
    close(np.concatenate(grads, axis=2), np.broadcast_to((g / (h * w)).reshape(n, c, 1, 1), x.shape), "its gradient")
