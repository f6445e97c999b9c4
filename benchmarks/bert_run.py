"""`poet-opt run --model bert-base` on the nRF52840 at 200 KiB, against plain PyTorch.

What `poet-opt run --model bert-base --data X.npz --device nrf52840 --ram 200KiB --lr 0.01 --steps 1`
does, as one call of run_training: the seeded twin (model/zoo_twins.py) lowered in row tiles
(its word and position tables cut into tiles of vocabulary rows), the plan solved here with
solve's defaults (--time-limit 60), then one SGD step executed step for step, the weights in
files under a temporary directory on this machine's disk. The same twin then trains one step of
autograd and torch.optim.SGD on the same batch. It prints, and with --write appends to
benchmarks/RUN_TILES.md, the largest difference of any trained weight from torch's (absolute, and
relative to the largest weight), the peak of live tensor bytes beside the plan's, the times, and
the process's peak resident memory (the run's, then with the reference step too).

    python benchmarks/bert_run.py            # long: about 13 minutes on 2 loaded cores, 3 GiB of RAM
    python benchmarks/bert_run.py --small    # the reduced BERT of tests/test_run_embedding.py, seconds
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LR = 0.01


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--small", action="store_true", help="the reduced BERT of the tests (d 32, 2 layers, 200 words, 16 tokens)")
    parser.add_argument("--write", action="store_true", help="append the figures to benchmarks/RUN_TILES.md")
    args = parser.parse_args()
    import torch

    from poet_opt.executor.train import run_training
    from poet_opt.model.zoo_twins import bert, zoo_module

    def factory():
        if not args.small:
            return zoo_module("bert-base")
        torch.manual_seed(0)
        return bert(d=32, heads=2, d_ff=64, layers=2, vocab=200, positions=128)

    seq, vocab = (16, 200) if args.small else (128, 30522)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, vocab, (1, seq)), np.array([1])
    with tempfile.TemporaryDirectory(prefix="bert-run-") as tmp:
        data = Path(tmp) / "batch.npz"
        np.savez(data, x=x, y=y)
        start = time.perf_counter()
        result = run_training(torch_model=factory(), input_shape=f"1,{seq}", device="nrf52840", ram="200KiB", steps=1,
                              lr=LR, data=data, time_limit=args.time_limit, storage=tmp,
                              **({"weights": "streamed", "strips": 2} if args.small else {}))
        run_s = time.perf_counter() - start
    run_rss = _rss_mib()
    module = factory()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    opt.step()
    reference = {n: p.detach().numpy() for n, p in module.named_parameters()}
    if set(result.weights) != set(reference):
        sys.exit(f"trained {sorted(set(result.weights) ^ set(reference))[:5]} differ from the module's parameters")
    worst, where = max((float(np.abs(result.weights[n] - v).max()), n) for n, v in reference.items())
    largest = max(float(np.abs(v).max()) for v in reference.values())
    s = result.summary()
    doc = result.schedule
    rows = [
        ("model", f"{'reduced BERT' if args.small else 'bert-base'}: {sum(v.size for v in reference.values()):,} "
                  f"parameters, {seq} token ids"),
        ("plan", f"{len(doc['graph']['nodes']):,} nodes, {len(doc['steps']):,} steps, {doc['solver']['status']}; "
                 f"{s['recomputes']:,} recomputes, {s['page_outs']:,} page-outs"),
        ("loss, run / torch", f"{s['loss'][0]:.7g} / {loss.item():.7g}"),
        ("max abs(run - torch) over the trained weights", f"{worst:.3g} ({where}); largest weight {largest:.3g}: "
                                                          f"{worst / largest:.3g} of it"),
        ("peak of live tensors, run / plan", f"{s['peak_live_bytes']:,} B / {s['planned_peak_bytes']:,} B"),
        ("storage written / read in the step", f"{s['storage_bytes_written']:,} B / {s['storage_bytes_read']:,} B"),
        ("run (lowering, solve, one step), wall", f"{run_s:.0f} s, the step {s['step_s'][0]:.0f} s"),
        ("peak resident memory of the process", f"{run_rss:,.0f} MiB after the run, {_rss_mib():,.0f} MiB with the "
                                                "torch reference step"),
    ]
    table = "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])
    print(table)
    if args.write:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with (ROOT / "benchmarks" / "RUN_TILES.md").open("a") as fh:
            fh.write(f"\n## `run --model bert-base` (nRF52840, 200 KiB), {stamp}\n\nWritten by `python "
                     f"benchmarks/bert_run.py --write`, on this 2-core machine shared with other work, torch "
                     f"{torch.__version__}.\n\n{table}\n")


if __name__ == "__main__":
    main()
