"""The PyTorch executor against plain training and torch.utils.checkpoint, on this machine's CPU.

For resnet18-cifar (poet_opt.examples.torch_models:resnet18, batch 8 of 3x32x32) and a transformer
block (poet_opt.examples.torch_models:transformer_block: d_model 768, 12 heads, d_ff 3072, one
sequence of 128): the nodes are timed as `poet-opt measure` times them, the schedule is solved on
rpi4 at 50% of plain training's peak (or the least any schedule needs, when that is more) with
those measured costs, and then, each in a fresh process:

- plain PyTorch training (autograd, torch.optim.SGD);
- the executor following the schedule (paging to a scratch directory on this machine's disk);
- torch.utils.checkpoint at 2, 4 and 8 segments (checkpoint_sequential over the stem and the eight
  blocks; the transformer block: the whole block, or its attention and feed-forward halves), of
  which the one whose memory is closest to the executor's is reported.

Memory of all three is measured the same way: the growth of the process's peak resident set over
the timed steps, from the resident set after the warm-up step with no gradients held (glibc told to
give every allocation over 64 KiB back to the system at once, so that the resident set follows the
live tensors). It includes the weight gradients (42.6 MiB for resnet18, 27.0 MiB for the block), which
all three hold. The executor also reports its own count, the peak of the live tensor bytes in its
table, beside the plan's. Wall time is the fastest of five timed steps after one warm-up step (the
machine is shared: other jobs only ever slow a step down, never speed it up). Everything runs on
one thread: two threads fighting other jobs for two cores make times swing tenfold. Last: the
solver's predicted runtime with the measured costs against the executor's measured runtime
(paging at rpi4's SD-card speed in the prediction, this machine's disk in the measurement).

    python benchmarks/executor.py            # the table, about 5 minutes; --quick: smaller inputs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 5  # timed, after one warm-up step
LR = 0.01
CASES = {  # name -> (factory, input shape, quick input shape)
    "resnet18-cifar": ("resnet18", (8, 3, 32, 32), (2, 3, 16, 16)),
    "transformer-block": ("transformer_block", (1, 128, 768), (1, 32, 768)),
}


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_rss_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak resident set starts again from now


def _module(case: str):
    import torch

    from poet_opt.examples import torch_models

    torch.manual_seed(0)
    return getattr(torch_models, CASES[case][0])()


def _batch(shape, classes):
    import torch

    rng = np.random.default_rng(1)
    return (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)),
            torch.from_numpy(rng.integers(0, classes, shape[0]).astype(np.int64)))


def _checkpointed_forward(module, case: str, segments: int):
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    if case == "resnet18-cifar":
        m = module
        body = torch.nn.Sequential(m.conv1, m.bn1, m.relu, *m.layer1, *m.layer2, *m.layer3, *m.layer4)

        def forward(x):
            x = checkpoint_sequential(body, segments, x, use_reentrant=False)
            return m.fc(torch.flatten(m.avgpool(x), 1))
        return forward
    m = module

    def attention(x):
        b, s, d = x.shape
        ctx = F.scaled_dot_product_attention(m._split(m.q(x)), m._split(m.k(x)), m._split(m.v(x)))
        return m.attn_ln(x + m.out(ctx.transpose(1, 2).reshape(b, s, d)))

    def ffn(x):
        return m.ffn_ln(x + m.fc2(m.gelu(m.fc1(x))))

    if segments == 1:
        return lambda x: checkpoint(lambda t: ffn(attention(t)), x, use_reentrant=False)
    return lambda x: checkpoint(ffn, checkpoint(attention, x, use_reentrant=False), use_reentrant=False)


def worker(case: str, method: str, shape, schedule_file: str | None, segments: int) -> dict:
    """One method in this (fresh) process: its step times and the growth of its peak resident set."""
    import torch

    torch.set_num_threads(1)
    module = _module(case)
    out = {}
    if method == "executor":
        from poet_opt.executor.runner import ScheduleExecutor
        from poet_opt.executor.train import prepare

        network = prepare(module, shape)
        x, y = _batch(shape, network.layers[network.output].elements // shape[0])
        doc = json.loads(Path(schedule_file).read_text())
        scratch = tempfile.mkdtemp(prefix="poet-bench-")
        step = ScheduleExecutor(network, doc, lr=LR, storage=scratch, device="cpu")

        def run():
            step(x, y)
    else:
        module.eval()
        with torch.no_grad():
            classes = module(_batch(shape, 1)[0])[0].numel()
        module.train()
        x, y = _batch(shape, classes)
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        forward = module if method == "plain" else _checkpointed_forward(module, case, segments)

        def run():
            opt.zero_grad(set_to_none=True)
            logits = forward(x)
            torch.nn.functional.cross_entropy(logits.reshape(logits.shape[0], -1), y).backward()
            opt.step()
    run()  # warm-up: lazily built kernels and lazily imported modules, which the growth must not count
    if method != "executor":
        opt.zero_grad(set_to_none=True)  # the executor holds no gradients between steps either
    base = _status_bytes("VmRSS")
    _reset_rss_peak()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    # the fastest step: on a shared machine the others are slowed by other jobs, never sped up
    out["step_s"] = min(times)
    out["step_median_s"] = statistics.median(times)
    out["rss_growth_bytes"] = max(0, _status_bytes("VmHWM") - base)
    if method == "executor":
        out["peak_live_bytes"] = step.last.peak_live_bytes
        out["planned_peak_bytes"] = step.planned_peak_bytes
        out["storage_bytes_written"] = step.last.storage_bytes_written
        step.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _spawn(case, method, shape, schedule_file=None, segments=0) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", case, method, ",".join(map(str, shape)), schedule_file or "-",
           str(segments)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{case} {method}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(quick: bool) -> None:
    import torch

    from poet_opt.executor.measure import costs_csv, measure_costs
    from poet_opt.executor.train import prepare
    from poet_opt.model.measured_costs import apply_costs, load_costs
    from poet_opt.solver.driver import solve

    torch.set_num_threads(1)
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="poet-bench-"))
    for case, (_, full_shape, quick_shape) in CASES.items():
        shape = quick_shape if quick else full_shape
        network = prepare(_module(case), shape)
        t0 = time.perf_counter()
        timings = measure_costs(network, warmup=1, repeat=5)
        measured_s = time.perf_counter() - t0
        costs_file = scratch / f"{case}.csv"
        costs_file.write_text(costs_csv(timings))
        graph = apply_costs(network.graph, load_costs(costs_file))
        plain = solve(graph, "rpi4", ram=10 ** 12, mode="none")
        # half of plain training's peak, or the least any schedule needs when that is more (a
        # transformer block's largest backward node holds more than half of it at once)
        budget = max(plain.totals["peak_ram_bytes"] // 2, graph.min_working_set_bytes())
        schedule = solve(graph, "rpi4", ram=budget, mode="joint", time_limit=60)
        schedule_file = scratch / f"{case}.json"
        schedule_file.write_text(json.dumps(schedule.to_dict()))
        print(f"{case} {shape}: measured in {measured_s:.1f} s; plan at {budget / 2**20:.2f} MiB: "
              f"{schedule.totals['recomputes']} recomputes, {schedule.totals['page_outs']} page-outs, "
              f"{schedule.solver['status']}", file=sys.stderr)
        print(f"  solved at {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        base = _spawn(case, "plain", shape)
        ex = _spawn(case, "executor", shape, str(schedule_file))
        checkpoints = {s: _spawn(case, "checkpoint", shape, segments=s)
                       for s in ((1, 2) if case == "transformer-block" else (2, 4, 8))}
        print(f"  ran at {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        seg, ck = min(checkpoints.items(), key=lambda kv: abs(kv[1]["rss_growth_bytes"] - ex["rss_growth_bytes"]))
        rows.append({"case": case, "shape": shape, "budget": budget, "plain_peak": plain.totals["peak_ram_bytes"],
                     "plan": schedule.totals, "plain": base, "executor": ex, "checkpoint": ck, "segments": seg,
                     "predicted_step_s": schedule.totals["runtime_s"],
                     "predicted_plain_s": plain.totals["runtime_s"]})
    shutil.rmtree(scratch, ignore_errors=True)
    print(table(rows))


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def table(rows) -> str:
    out = ["| case | plain peak | budget | plan peak | executor live peak | executor / plan peak | "
           "recomputes, page-outs | plain: step, RSS growth | executor: step, RSS growth | "
           "checkpoint (segments): step, RSS growth | executor / plain: time, RSS | executor / checkpoint: time, RSS | "
           "executor measured / predicted runtime (plain) |",
           "|" + "---|" * 13]
    for r in rows:
        p, e, c = r["plain"], r["executor"], r["checkpoint"]
        out.append(
            f"| {r['case']} {'x'.join(map(str, r['shape']))} | {_mib(r['plain_peak'])} MiB | {_mib(r['budget'])} MiB | "
            f"{_mib(e['planned_peak_bytes'])} MiB | {_mib(e['peak_live_bytes'])} MiB | "
            f"{e['peak_live_bytes'] / e['planned_peak_bytes']:.3f} | {r['plan']['recomputes']}, {r['plan']['page_outs']} | "
            f"{p['step_s']:.3f} s, {_mib(p['rss_growth_bytes'])} MiB | {e['step_s']:.3f} s, {_mib(e['rss_growth_bytes'])} MiB | "
            f"({r['segments']}) {c['step_s']:.3f} s, {_mib(c['rss_growth_bytes'])} MiB | "
            f"{e['step_s'] / p['step_s']:.2f}, {e['rss_growth_bytes'] / max(1, p['rss_growth_bytes']):.2f} | "
            f"{e['step_s'] / c['step_s']:.2f}, {e['rss_growth_bytes'] / max(1, c['rss_growth_bytes']):.2f} | "
            f"{e['step_s'] / r['predicted_step_s']:.2f} ({p['step_s'] / r['predicted_plain_s']:.2f}) |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        case, method, shape, schedule_file, segments = sys.argv[2:7]
        result = worker(case, method, tuple(int(v) for v in shape.split(",")),
                        None if schedule_file == "-" else schedule_file, int(segments))
        print(json.dumps(result))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs, for a check that it runs")
    main(parser.parse_args().quick)
