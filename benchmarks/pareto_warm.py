"""What warm starts save in a Pareto sweep: the same sweep solved cold (every point from the
heuristic starts) and warm (every point from the schedule of the budget below it), side by side.

    .venv/bin/python benchmarks/pareto_warm.py --repeat 3            # VGG-16 (CIFAR), two devices
    .venv/bin/python benchmarks/pareto_warm.py --model resnet18-cifar --device rpi4 \
        --device nrf52840 --ram-from 1MB --ram-to 5MB --points 12 --time-limit 25

Prints, per point, the solve seconds of both runs and their ratio, then the totals. Both runs use
the same --jobs (default 1: on a shared machine a pool's timings depend on the neighbours more).
With --repeat N the cold and warm sweeps alternate N times each and every point reports its
median, so a burst of load from elsewhere does not land on one side only.
Energies must agree within the gap for proven points; a point that hit the time limit in either
run is flagged, since a time-limited point's energy depends on how far the search got.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from poet_opt import pareto
from poet_opt.units import format_bytes


def run(args, warm: bool):
    started = time.perf_counter()
    rows = pareto.sweep(args.model, args.device, pareto.ram_range(args.ram_from, args.ram_to, args.points),
                        runtime=args.runtime, modes=args.modes.split(","), time_limit=args.time_limit, gap=args.gap,
                        jobs=args.jobs, warm=warm)
    return rows, time.perf_counter() - started


def median_rows(runs):
    """The first run's rows with each point's solve_s replaced by its median over the runs."""
    rows = [dict(r) for r in runs[0]]
    for k, row in enumerate(rows):
        row["solve_s"] = statistics.median(run[k]["solve_s"] for run in runs)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vgg16-cifar")
    ap.add_argument("--device", action="append", default=None)
    ap.add_argument("--ram-from", default="1.1MB")
    ap.add_argument("--ram-to", default="2.4MB")
    ap.add_argument("--points", type=int, default=6)
    ap.add_argument("--runtime", default=None)
    ap.add_argument("--modes", default="joint")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--gap", type=float, default=1e-3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="alternate cold and warm sweeps this many times")
    args = ap.parse_args(argv)
    args.device = args.device or ["nrf52840", "rpi4"]

    colds, warms = [], []
    for _ in range(max(1, args.repeat)):
        colds.append(run(args, warm=False))
        warms.append(run(args, warm=True))
    cold, warm = median_rows([r for r, _ in colds]), median_rows([r for r, _ in warms])
    cold_wall = statistics.median(w for _, w in colds)
    warm_wall = statistics.median(w for _, w in warms)

    print(f"{args.model} on {', '.join(args.device)}, {args.points} budgets {args.ram_from}..{args.ram_to}, "
          f"time limit {args.time_limit:g} s/point, gap {args.gap:g}, jobs {args.jobs}, "
          f"median of {max(1, args.repeat)} run(s) each")
    print(f"{'device':<10} {'mode':<7} {'RAM':>9} {'status cold/warm':<22} {'cold s':>8} {'warm s':>8} "
          f"{'warm/cold':>9}  {'gap cold/warm':<17} energy warm/cold")
    mismatches = 0
    for c, w in zip(cold, warm):
        assert (c["device"], c["mode"], c["ram_bytes"]) == (w["device"], w["mode"], w["ram_bytes"])
        ratio = f"{w['solve_s'] / c['solve_s']:.2f}" if c["solve_s"] > 0 else "-"
        energy = "-"
        if c["energy_j"] is not None and w["energy_j"] is not None:
            rel = w["energy_j"] / c["energy_j"]
            energy = f"{rel:.6f}"
            proven = c["status"] != "time_limit" and w["status"] != "time_limit"
            if proven and abs(rel - 1) > 2 * args.gap + 1e-9:
                energy += "  MISMATCH"
                mismatches += 1
            elif not proven:
                energy += "  (time limit)"
        gaps = "/".join("-" if r["gap"] is None else f"{r['gap']:.2g}" for r in (c, w))
        print(f"{c['device']:<10} {c['mode']:<7} {format_bytes(c['ram_bytes']):>9} "
              f"{c['status'] + '/' + w['status']:<22} {c['solve_s']:>8.2f} {w['solve_s']:>8.2f} {ratio:>9}  "
              f"{gaps:<17} {energy}")
    cold_s = sum(r["solve_s"] for r in cold)
    warm_s = sum(r["solve_s"] for r in warm)
    print(f"solve seconds: cold {cold_s:.1f}, warm {warm_s:.1f}, warm/cold {warm_s / cold_s:.2f}")
    print(f"wall seconds:  cold {cold_wall:.1f}, warm {warm_wall:.1f}, warm/cold {warm_wall / cold_wall:.2f}")
    print("(on a shared machine timings are noisy: use --repeat 3 or more before trusting a ratio near 1)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
