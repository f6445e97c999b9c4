"""`poet-opt run` on ResNet-18's strip + slice plan for the nRF52840 at 200 KiB, against plain PyTorch.

The plan is the one `poet-opt solve --torch poet_opt.examples.torch_models:resnet18 --input-shape
1,3,32,32 --device nrf52840 --ram 200KiB --time-limit 60` writes: streamed weights, activation
strips and weight slices, all chosen by solve's defaults. Then, as `poet-opt run --schedule` does,
the executor trains one SGD step with it in PyTorch (the weights in files on this machine's disk,
read into RAM as the plan's param nodes say, updated in place and written back), and the same
module trains one step of autograd and torch.optim.SGD on the same batch. It prints, and with
--write appends to benchmarks/RUN_TILES.md, the largest difference of any trained weight from
torch's (absolute, and relative to the largest weight), the measured peak of live tensor bytes
beside the plan's, the storage traffic beside the plan's, and the times (one thread).

    python benchmarks/run_tiles.py            # long: about 5 to 10 minutes on 2 loaded cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SPEC = "poet_opt.examples.torch_models:resnet18"
SHAPE = "1,3,32,32"
LR = 0.01


def _sgd_step(module, x, y, dtype):
    """One step of autograd and torch.optim.SGD on a copy of ``module``: (weights, loss)."""
    import copy

    import torch

    module = copy.deepcopy(module).to(dtype)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x).to(dtype)).flatten(1), torch.from_numpy(y))
    loss.backward()
    opt.step()
    return {n: p.detach().float().numpy() for n, p in module.named_parameters()}, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--write", action="store_true", help="append the figures to benchmarks/RUN_TILES.md")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from poet_opt.executor.train import run_training

    with tempfile.TemporaryDirectory(prefix="run-tiles-") as tmp:
        plan = Path(tmp) / "plan.json"
        start = time.perf_counter()
        solved = subprocess.run([sys.executable, "-m", "poet_opt.cli", "solve", "--torch", SPEC, "--input-shape", SHAPE,
                                 "--device", "nrf52840", "--ram", "200KiB", "--time-limit", str(args.time_limit), "-q",
                                 "--out", str(plan)], capture_output=True, text=True, cwd=ROOT)
        if solved.returncode:
            sys.exit(solved.stderr)
        solve_s = time.perf_counter() - start
        doc = json.loads(plan.read_text())
        rng = np.random.default_rng(0)
        data = Path(tmp) / "batch.npz"
        x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
        y = np.array([3])
        np.savez(data, x=x, y=y)
        from poet_opt.examples.torch_models import resnet18

        torch.manual_seed(0)  # the factory does not seed: the same initial weights every time
        start = time.perf_counter()
        result = run_training(torch_model=resnet18(), input_shape=SHAPE, steps=1, lr=LR, data=data, schedule=plan,
                              storage=tmp)
        run_s = time.perf_counter() - start
    module = result.network.module  # untouched by the run: its weights live on storage
    reference, loss = _sgd_step(module, x, y, torch.float32)
    # how exact fp32 can be here at all: batch norm over one sample amplifies rounding, and some
    # initial weights make torch's own fp32 step differ from its fp64 step by 1e-4 (seen on others)
    exact, _ = _sgd_step(module, x, y, torch.float64)
    worst, where = max((float(np.abs(result.weights[n] - v).max()), n) for n, v in reference.items())
    largest = max(float(np.abs(v).max()) for v in reference.values())
    fp64 = max(float(np.abs(reference[n] - v).max()) for n, v in exact.items())
    s = result.summary()
    names = [n["name"] for n in doc["graph"]["nodes"]]
    computed = [names[st["node"]] for st in doc["steps"] if st["op"] == "compute"]
    rows = [
        ("plan", f"{len(names):,} nodes, {len(doc['steps']):,} steps; {sum('@s' in n for n in set(computed)):,} strip "
                 f"nodes, {sum('#' in n for n in set(computed)):,} slice nodes, "
                 f"{sum(n.startswith('param:') for n in computed):,} weight reads"),
        ("loss, run / torch", f"{s['loss'][0]:.7g} / {loss.item():.7g}"),
        ("max abs(run - torch) over the trained weights", f"{worst:.3g} ({where}); largest weight {largest:.3g}: "
                                                          f"{worst / largest:.3g} of it"),
        ("max abs(torch fp32 - torch fp64), for scale", f"{fp64:.3g}"),
        ("peak of live tensors, run / plan", f"{s['peak_live_bytes']:,} B / {s['planned_peak_bytes']:,} B"),
        ("storage written, run / plan", f"{s['storage_bytes_written']:,} B / {s['planned_storage_bytes_written']:,} B"),
        ("storage read, run / plan", f"{s['storage_bytes_read']:,} B / {s['planned_storage_bytes_read']:,} B"),
        ("solve, wall", f"{solve_s:.0f} s"),
        ("run (lowering, checks, one step), wall", f"{run_s:.0f} s, the step {s['step_s'][0]:.0f} s"),
    ]
    table = "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])
    print(table)
    if args.write:
        out = ROOT / "benchmarks" / "RUN_TILES.md"
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        head = "" if out.exists() else ("# `poet-opt run` on ResNet-18's strip + slice plan (nRF52840, 200 KiB)\n\n"
                                        "Written by `python benchmarks/run_tiles.py --write`.\n")
        with out.open("a") as fh:
            fh.write(f"{head}\n## {stamp}\n\n{table}\n")


if __name__ == "__main__":
    main()
