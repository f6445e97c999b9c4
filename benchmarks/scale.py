"""Where the exact solver's time goes on the scale targets of issue 5 (run by hand, not in CI).

For each case: model-building time, MILP size, the LP relaxation (value and time), the heuristic
MIP start, and the full solve() pipeline under the time limit with its incumbent/bound/gap over
time (time to first incumbent, gap at 10 s, 30 s and the end). Prints one Markdown table.

    .venv/bin/python benchmarks/scale.py                 # all cases
    .venv/bin/python benchmarks/scale.py --cases r50-rpi4,bert-rpi4 --threads 2
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import replace

import numpy as np

from poet_opt.device.costs import node_costs
from poet_opt.device.profiles import load_profile
from poet_opt.model.random_graph import random_training_graph
from poet_opt.model.zoo import build_model
from poet_opt.schedule.decisions import build_steps, totals_of
from poet_opt.solver.backends import solve_milp
from poet_opt.solver.driver import resolve_budgets, solve
from poet_opt.solver.formulation import Formulation
from poet_opt.solver.heuristics import starting_points

try:  # absent before the gap MILP existed: the "before" run has no such column
    from poet_opt.solver.gap_milp import gap_milp_plan
except ImportError:
    gap_milp_plan = None


def _zoo(name):
    return lambda: build_model(name)


# id -> (graph factory, device, ram as a fraction of the plain peak or an absolute size, runtime, time limit)
CASES = {
    "r18-readme": (_zoo("resnet18-cifar"), "rpi4", "1.5MB", "1.2x", 60.0),
    "r50-rpi4": (_zoo("resnet50"), "rpi4", 0.5, None, 60.0),
    "r50-nano": (_zoo("resnet50"), "jetson-nano", 0.5, None, 60.0),
    "bert-rpi4": (_zoo("bert-base"), "rpi4", 0.5, None, 60.0),
    "bert-nano": (_zoo("bert-base"), "jetson-nano", 0.5, None, 60.0),
    "r50-tx2": (_zoo("resnet50"), "jetson-tx2", 0.5, None, 60.0),
    "bert-tx2": (_zoo("bert-base"), "jetson-tx2", 0.5, None, 60.0),
    "rand1000-rpi4": (lambda: random_training_graph(500, 0), "rpi4", 0.5, None, 120.0),
    "rand1000-nano": (lambda: random_training_graph(500, 0), "jetson-nano", 0.5, None, 120.0),
}


def lp_relaxation(milp, time_limit, threads):
    relaxed = replace(milp, integrality=np.zeros_like(milp.integrality))
    r = solve_milp(relaxed, time_limit=time_limit, gap=0.0, threads=threads)
    # without integers HiGHS reports a dual bound of 0 and calls the LP optimum a gap_limit stop
    return r.objective if r.status in ("optimal", "gap_limit") else None, r.solve_s


def run_case(case_id, threads, lp, time_limit_override, gap):
    make, device, ram, runtime, time_limit = CASES[case_id]
    if time_limit_override:
        time_limit = time_limit_override
    t0 = time.perf_counter()
    graph = make()
    graph_s = time.perf_counter() - t0
    profile = load_profile(device)
    costs = node_costs(graph, profile)
    ram_bytes = int(ram * graph.plain_peak_bytes()) if isinstance(ram, float) else ram
    budgets = resolve_budgets(graph, profile, costs, ram_bytes, runtime)
    row = {"case": case_id, "nodes": len(graph), "graph_s": graph_s}

    t0 = time.perf_counter()
    form = Formulation(graph, costs, budgets, "joint")
    row["build_s"] = time.perf_counter() - t0
    milp = form.milp
    row.update(vars=milp.num_vars, ints=int(milp.integrality.sum()), rows=milp.num_rows, nnz=milp.A.nnz)

    t0 = time.perf_counter()
    starts = starting_points(graph, costs, budgets, "joint")
    row["heur_s"] = time.perf_counter() - t0
    row["heur_j"] = (totals_of(graph, costs, build_steps(graph, starts[0]))["energy_j"] if starts else None)
    if gap_milp_plan is not None:
        t0 = time.perf_counter()
        plan = gap_milp_plan(graph, costs, budgets, "joint", time_limit=time_limit, threads=threads)
        row["gapmilp_s"] = time.perf_counter() - t0
        row["gapmilp_j"] = totals_of(graph, costs, build_steps(graph, plan))["energy_j"] if plan else None
    row["plain_j"] = costs.plain_energy_j
    if lp:
        row["lp_j"], row["lp_s"] = lp_relaxation(milp, time_limit, threads)
    del form, milp

    timeline = []
    t0 = time.perf_counter()
    schedule = solve(graph, profile, ram=ram_bytes, runtime=runtime, time_limit=time_limit, threads=threads,
                     gap=gap, progress=timeline.append)
    row["total_s"] = time.perf_counter() - t0
    s = schedule.solver
    row.update(status=s["status"], energy_j=schedule.totals["energy_j"], bound_j=s["bound"], gap=s["gap"],
               solve_s=s["solve_s"], full=s.get("full_milp", "solved"))
    return row


def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def _pct(value):
    return "-" if value is None else f"{100 * value:.2f}%"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=None, help="override every case's time limit")
    ap.add_argument("--no-lp", action="store_true", help="skip the LP relaxation measurement")
    ap.add_argument("--gap", type=float, default=1e-3, help="relative gap asked of solve()")
    args = ap.parse_args(argv)
    print(f"# scale.py on {platform.node()} ({platform.processor() or platform.machine()}), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, threads={args.threads}, gap={args.gap}")
    print()
    head = ("case", "nodes", "graph s", "build s", "vars", "int vars", "rows", "nnz", "heur s", "heur/plain",
            "gap MILP s", "gap MILP/plain", "LP s", "LP/plain", "solve() wall s", "status", "energy/plain",
            "bound/plain", "gap", "full MILP")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for case_id in args.cases.split(","):
        r = run_case(case_id, args.threads, not args.no_lp, args.time_limit, args.gap)
        plain = r["plain_j"]
        cells = (r["case"], r["nodes"], _f(r["graph_s"], ".3f"), _f(r["build_s"], ".2f"), r["vars"], r["ints"],
                 r["rows"], r["nnz"], _f(r["heur_s"], ".2f"), _f(r["heur_j"] / plain if r["heur_j"] else None, ".5f"),
                 _f(r.get("gapmilp_s"), ".2f"), _f(r["gapmilp_j"] / plain if r.get("gapmilp_j") else None, ".5f"),
                 _f(r.get("lp_s"), ".1f"), _f(r["lp_j"] / plain if r.get("lp_j") else None, ".5f"),
                 _f(r["total_s"], ".1f"), r["status"],
                 _f(r["energy_j"] / plain, ".5f"), _f(r["bound_j"] / plain if r["bound_j"] else None, ".5f"),
                 _pct(r["gap"]), r["full"])
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
