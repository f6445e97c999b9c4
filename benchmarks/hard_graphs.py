"""The hard class of issue 16, HiGHS (our default) against the CP-SAT backend, side by side in one run.

Cases: the zoo's ResNet-50 and MobileNetV2 training graphs, and random layered training graphs of
100, 250, 500 and 1000 forward nodes (``../shared/gen_layered.py``, seed 1), at 90%, 80% and 70% of
their plain-training peak, in remat and joint modes, on the Raspberry Pi 4 profile. Every case runs
``poet_opt.solver.driver.solve`` once per solver, with the same time limit, gap and threads, in the
given execution order. For each it prints the objective, the proven bound, the gap, the time to
the first schedule, the time to proof (reaching the requested gap), and the wall time, then the
ratios CP-SAT / HiGHS.

"First schedule" is when the first valid plan was in hand: the heuristic starts, if they found one
(both solvers start from them), else the first incumbent the solver reported (progress is reported
at most once a second, so it is late by up to a second); "<= wall" when only the final answer had
one. "Proof" is the wall time of a run that ended within the requested gap (status optimal,
optimal_for_order or gap_limit), "-" otherwise.

    .venv/bin/python benchmarks/hard_graphs.py --quick                 # 3 cases, 6 solves, about 2.5 minutes
    .venv/bin/python benchmarks/hard_graphs.py                          # 36 cases x 2 solvers x 120 s
    .venv/bin/python benchmarks/hard_graphs.py --cases r50,l100 --fractions 0.8 --modes remat

A full run is at most 36 cases x 2 solvers x 120 s = 2.4 hours on 2 cores; it took 58 minutes on
2026-11-26 (benchmarks/HARD.md), where HiGHS proved most cases in seconds and CP-SAT ran to its
limit in 18 of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from poet_opt.errors import InfeasibleError, NoScheduleFound, PoetError  # noqa: E402
from poet_opt.model.node_link import load_node_link  # noqa: E402
from poet_opt.model.zoo import build_model  # noqa: E402
from poet_opt.solver import driver  # noqa: E402

SHARED = ROOT.parent / "shared"
GRAPHS = {"r50": "resnet50", "mnv2": "mobilenetv2", "l100": 100, "l250": 250, "l500": 500, "l1000": 1000}
FRACTIONS = (0.9, 0.8, 0.7)
MODES = ("remat", "joint")
SOLVERS = ("highs", "cpsat")
QUICK_TIME_LIMIT = 20.0
QUICK_CASES = [("l100", 0.9, "remat"), ("l100", 0.8, "remat"), ("mnv2", 0.9, "remat")]


def load_graph(key: str):
    what = GRAPHS[key]
    if isinstance(what, str):
        return build_model(what)
    spec = importlib.util.spec_from_file_location("gen_layered", SHARED / "gen_layered.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"layered-{what}.json"
        path.write_text(json.dumps(gen.make(1, what)))
        return load_node_link(path)


def run_one(graph, frac: float, mode: str, backend: str, time_limit: float, threads: int, gap: float) -> dict:
    ram = int(frac * graph.plain_peak_bytes())
    began = time.perf_counter()
    first = [None]
    original = driver.starting_points

    def timed_starts(*args, **kwargs):  # both solvers start from these: a plan in hand from then on
        found = original(*args, **kwargs)
        if found and first[0] is None:
            first[0] = time.perf_counter() - began
        return found

    def progress(p):
        if p.incumbent is not None and first[0] is None:
            first[0] = time.perf_counter() - began

    driver.starting_points = timed_starts
    row = {"backend": backend}
    try:
        schedule = driver.solve(graph, "rpi4", ram=ram, mode=mode, backend=backend, time_limit=time_limit,
                                gap=gap, threads=threads, order="given", progress=progress)
    except InfeasibleError as exc:
        row.update(status="infeasible" if exc.proven else "infeasible in this order")
    except NoScheduleFound:
        row.update(status="no schedule")
    except PoetError as exc:
        row.update(status=f"error: {exc}")
    else:
        s = schedule.solver
        row.update(status=s["status"], objective=schedule.totals["energy_j"], bound=s["bound"], gap=s["gap"],
                   floor=s["plain_floor_j"],
                   note=f"{s.get('full_milp', '')}; bound from {s.get('bound_source', 'the solver')}")
    finally:
        driver.starting_points = original
    row["wall"] = time.perf_counter() - began
    row["first"] = first[0] if first[0] is not None else (row["wall"] if "objective" in row else None)
    row["first_is_end"] = first[0] is None and "objective" in row
    row["proof"] = row["wall"] if row.get("status") in ("optimal", "optimal_for_order", "gap_limit") else None
    return row


def _num(x, fmt="{:.6g}"):
    return "-" if x is None else fmt.format(x)


def _cell(row: dict) -> list[str]:
    first = "-" if row["first"] is None else (("<= " if row["first_is_end"] else "") + f"{row['first']:.1f}")
    above = None
    if row.get("bound") is not None and row.get("floor"):
        above = 100 * (row["bound"] - row["floor"]) / row["floor"]
    return [row["status"], _num(row.get("objective")), _num(row.get("bound")),
            "-" if row.get("gap") is None else f"{100 * row['gap']:.3f}%",
            "-" if above is None else f"{above:+.3f}%", first, _num(row["proof"], "{:.1f}"), f"{row['wall']:.1f}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 cases, 20 s each: a smoke run of the whole table")
    ap.add_argument("--cases", default=",".join(GRAPHS), help=f"comma-separated, of {', '.join(GRAPHS)}")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gap", type=float, default=1e-3)
    ap.add_argument("--solvers", default=",".join(SOLVERS))
    ap.add_argument("--out", help="also write the table (Markdown) to this file")
    args = ap.parse_args(argv)
    if args.quick:
        cases, limit = QUICK_CASES, QUICK_TIME_LIMIT
    else:
        cases = [(c, float(f), m) for c in args.cases.split(",") for f in args.fractions.split(",")
                 for m in args.modes.split(",")]
        limit = args.time_limit
    solvers = args.solvers.split(",")

    head = (f"`benchmarks/hard_graphs.py{' --quick' if args.quick else ''}` (poet-opt, Python "
            f"{platform.python_version()}, {limit:g} s per solve, {args.threads} thread(s), gap {args.gap:g}, rpi4, "
            f"given order)")
    cols = ["status", "objective J", "bound J", "gap", "bound over floor", "first s", "proof s", "wall s"]
    header = ["case", "nodes", "RAM"] + [f"{s} {c}" for s in solvers for c in cols] + ["obj cpsat/highs",
                                                                                      "proof cpsat/highs"]
    lines = [head, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    print("\n".join(lines), flush=True)
    graphs: dict = {}
    obj_ratios, proof_ratios, walls, cpsat_lower = [], [], [], []
    for key, frac, mode in cases:
        if key not in graphs:
            graphs[key] = load_graph(key)
        graph = graphs[key]
        rows = {s: run_one(graph, frac, mode, s, limit, args.threads, args.gap) for s in solvers}
        walls += [r["wall"] for r in rows.values()]
        ratio_obj = ratio_proof = "-"
        if {"highs", "cpsat"} <= set(rows):
            h, c = rows["highs"], rows["cpsat"]
            if h.get("objective") and c.get("objective"):
                obj_ratios.append(c["objective"] / h["objective"])
                if obj_ratios[-1] < 1.0:
                    cpsat_lower.append(f"{key} {mode} {int(frac * 100)}%: {c['objective']!r} J against "
                                       f"{h['objective']!r} J, {1 - obj_ratios[-1]:.2e} lower")
                ratio_obj = f"{obj_ratios[-1]:.6f}"
            if h["proof"] and c["proof"]:
                # proven by plain training's energy alone (no solver needed) or by a solver's bound
                by_floor = "plain-training floor" in h.get("note", "").split("; bound from")[0]
                proof_ratios.append((c["proof"] / h["proof"], by_floor))
                ratio_proof = f"{proof_ratios[-1][0]:.2f}"
        cells = [f"{key} {mode}", str(len(graph)), f"{int(frac * 100)}%"]
        for s in solvers:
            cells += _cell(rows[s])
        line = "| " + " | ".join(cells + [ratio_obj, ratio_proof]) + " |"
        lines.append(line)
        print(line, flush=True)
        for s in solvers:
            if rows[s].get("note"):
                print(f"    {key} {mode} {frac:g} {s}: {rows[s]['note']}", file=sys.stderr, flush=True)
    summary = [""]
    if obj_ratios:
        summary.append(f"- objective cpsat / highs where both have a schedule: median {statistics.median(obj_ratios):.6f},"
                       f" from {min(obj_ratios):.9f} to {max(obj_ratios):.6f} over {len(obj_ratios)} cases; CP-SAT "
                       f"lower in {len(cpsat_lower)}"
                       + (f", by up to {100 * (1 - min(obj_ratios)):.5f}%" if cpsat_lower else ""))
        summary += [f"  - {line}" for line in cpsat_lower]
    if proof_ratios:
        summary.append(f"- time to proof cpsat / highs where both prove: median "
                       f"{statistics.median(r for r, _ in proof_ratios):.2f}x over {len(proof_ratios)} cases")
        solved = [r for r, by_floor in proof_ratios if not by_floor]
        summary.append(f"  ({len(proof_ratios) - len(solved)} of them HiGHS proved by a start within the gap of "
                       f"plain training's energy; the other {len(solved)}"
                       + (f": median {statistics.median(solved):.2f}x)" if solved else ")"))
    summary.append(f"- time limit {limit:g} s: longest wall time {max(walls):.1f} s over {len(walls)} solves")
    print("\n".join(summary), flush=True)
    lines += summary
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
