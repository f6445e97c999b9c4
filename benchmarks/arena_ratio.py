"""Static arena against the live-bytes peak: how much RAM firmware needs beyond what the MILP bounds
(issue 3's closing figure). Run by hand, not in CI; about 10 minutes on one core.

For every example in schedules/examples/ (as checked in), and for every zoo model on two devices
at a RAM budget 30% below its plain-training peak (solved here with poet_opt.firmware.fit.solve_for_export,
as `poet-opt solve --export` does), prints and writes to benchmarks/ARENA.md, side by side:

- ``size``: greedy by size alone (TFLite Micro's planner), the baseline;
- ``classic``: the classic orders and seeded restarts, before any local search;
- ``arena``: what the export uses (plus the local search), and the rounds of re-solving it took;

each as arena bytes / live-bytes peak of the same schedule, then median and worst over the rows.
A model that has no schedule at that budget is reported as infeasible with the smallest feasible
budget the solver names. Zoo networks are mostly chains of equal-sized, well-aligned tensors and
rarely fragment; random training graphs with skip connections (poet_opt.model.random_graph, budget 30% of
the way from the minimum working set to the plain peak) do, and are reported as a separate group.

    .venv/bin/python benchmarks/arena_ratio.py
    .venv/bin/python benchmarks/arena_ratio.py --models mlp,mcu-vww --devices rpi4 --time-limit 10
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from poet_opt import __version__
from poet_opt.device.profiles import load_profile
from poet_opt.errors import InfeasibleError, PoetError
from poet_opt.firmware import arena
from poet_opt.firmware.fit import solve_for_export
from poet_opt.model.random_graph import random_training_graph
from poet_opt.model.zoo import MODELS, build_model
from poet_opt.schedule.validator import load_and_validate
from poet_opt.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "schedules" / "examples"


def baseline_ratios(doc: dict) -> tuple[float, float]:
    """Greedy by size alone, and the classic orders with restarts, on the same schedule."""
    intervals, _ = arena.resident_intervals(doc)
    near = arena._neighbours(intervals)
    alignment = doc["device"]["alignment_bytes"]
    peak = arena.live_peak(intervals)
    if not peak:
        return 1.0, 1.0
    size = sorted(range(len(intervals)), key=lambda k: (-intervals[k].bytes, intervals[k].start - intervals[k].end, k))
    by_size = arena._extent(intervals, arena._place(intervals, near, size, alignment))
    classic = arena._best_placement(intervals, near, alignment, arena.padded_lower_bound(intervals, alignment))[0]
    return by_size / peak, classic / peak


def measure(label: str, device: str, budget: int, doc: dict, rounds: int, solve_s: float) -> dict:
    started = time.perf_counter()
    plan = arena.plan_arena(doc)
    plan_s = time.perf_counter() - started
    by_size, classic = baseline_ratios(doc)
    return {"case": label, "device": device, "budget": budget, "peak": plan.live_peak_bytes,
            "bound": plan.lower_bound_bytes, "arena": plan.arena_bytes, "ratio": plan.ratio, "size": by_size,
            "classic": classic, "rounds": rounds, "intervals": len(plan.intervals), "plan_s": plan_s,
            "solve_s": solve_s, "status": doc["solver"]["status"]}


def solve_case(model: str, device: str, time_limit: float, threads: int, graph=None) -> dict:
    profile = load_profile(device)
    if graph is None:
        graph = build_model(model, bytes_per_element=profile.memory.bytes_per_element)
        budget = int(0.7 * graph.plain_peak_bytes())
    else:
        lo, hi = graph.min_working_set_bytes(), graph.plain_peak_bytes()
        budget = int(lo + 0.3 * (hi - lo))
    started = time.perf_counter()
    try:
        result = solve_for_export(graph, profile, ram=budget, time_limit=time_limit, threads=threads,
                                  model_name=model)
    except InfeasibleError as exc:
        return {"case": model, "device": device, "budget": budget, "infeasible": exc.min_ram_bytes,
                "message": exc.message}
    except PoetError as exc:
        return {"case": model, "device": device, "budget": budget, "error": exc.message}
    return measure(model, device, budget, result.schedule.to_dict(), len(result.rounds),
                   time.perf_counter() - started)


def fmt_row(r: dict) -> list[str]:
    head = [r["case"], r["device"], format_bytes(r["budget"])]
    if "infeasible" in r:
        least = "none" if r["infeasible"] is None else format_bytes(r["infeasible"])
        return head + ["infeasible", "-", "-", "-", "-", "-", "-", f"smallest feasible budget {least}"]
    if "error" in r:
        return head + ["error", "-", "-", "-", "-", "-", "-", r["error"]]
    return head + [f"{r['peak']:,}", f"{r['arena']:,}", f"{r['size']:.4f}", f"{r['classic']:.4f}",
                   f"{r['ratio']:.4f}", str(r["rounds"]), f"{r['plan_s']:.2f}",
                   f"{r['intervals']} intervals; bound {r['bound']:,} B; solver {r['status']}"]


HEADER = ["case", "device", "RAM budget", "live peak B", "arena B", "size", "classic", "arena / peak",
          "solves", "plan s", "notes"]


def summary(rows: list[dict]) -> list[str]:
    out = []
    for group, label in (("zoo", "examples and zoo"), ("random", "random graphs")):
        for key, name in (("size", "greedy by size (baseline)"), ("classic", "classic orders + restarts"),
                          ("ratio", "exported arena")):
            values = [r[key] for r in rows if key in r and r.get("group", "zoo") == group]
            if values:
                out.append(f"{label}, {name}: median {statistics.median(values):.4f}, "
                           f"worst {max(values):.4f} over {len(values)} schedules")
    return out


def write_markdown(rows: list[dict], path: Path, args) -> None:
    lines = [
        "# Static arena / live-bytes peak",
        "",
        f"`benchmarks/arena_ratio.py` (poet-opt {__version__}, Python {platform.python_version()}, "
        f"{args.time_limit:g} s per solve, {args.threads} thread(s)). Zoo rows: RAM budget 30% below the "
        "plain-training peak, solved by `poet_opt.firmware.fit.solve_for_export`; example rows: the schedules "
        "in `schedules/examples/` as checked in.",
        "",
        "Ratios are arena bytes / live-bytes peak of the same schedule: `size` is greedy by size alone "
        "(TFLite Micro's planner), `classic` the classic orders with seeded restarts, `arena / peak` what "
        "the export uses (with the local search). `solves`: 1, or more when the arena did not fit and the "
        "schedule was solved again with a tighter budget (docs/c-export.md).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(fmt_row(r)) + " |" for r in rows]
    lines += ["", *[f"- {s}" for s in summary(rows)], ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo models")
    parser.add_argument("--devices", default="rpi4,jetson-nano", help="comma-separated device profiles")
    parser.add_argument("--time-limit", type=float, default=25.0, help="seconds per solve")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "ARENA.md")
    parser.add_argument("--no-examples", action="store_true", help="skip schedules/examples/")
    parser.add_argument("--random", type=int, default=10, help="random graphs per size (12 and 16 forward nodes)")
    args = parser.parse_args(argv)

    rows: list[dict] = []
    print(" | ".join(HEADER), flush=True)

    def add(row):
        rows.append(row)
        print(" | ".join(fmt_row(row)), flush=True)
        write_markdown(rows, args.out, args)  # a long run keeps what it has measured

    if not args.no_examples:
        for path in sorted(EXAMPLES.glob("*.json")):
            doc, _ = load_and_validate(path)
            rounds = 1 + ("ram_bytes_solved" in doc["solver"])
            add(measure(f"example {path.stem}", doc["device"]["name"], doc["budgets"]["ram_bytes"], doc,
                        rounds, 0.0))
    for model in args.models.split(","):
        for device in args.devices.split(","):
            add(solve_case(model, device, args.time_limit, args.threads))
    for n_forward in (12, 16):
        for seed in range(args.random):
            graph = random_training_graph(n_forward, seed, skip_prob=0.5)
            add({**solve_case(graph.name, args.devices.split(",")[0], args.time_limit, args.threads, graph),
                 "group": "random"})
    print("\n".join(summary(rows)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
