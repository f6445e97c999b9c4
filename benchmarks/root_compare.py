"""Why is ours slower than the dense model on some small cases? Root LP bounds, node counts and
times of both MILPs, side by side (run by hand, not in CI).

For each case of ``bench.py`` (``model@device@fraction@mode``), both models are built and given to
HiGHS twice: as an LP (integrality dropped: the root relaxation, before presolve and cuts) and as
the MILP, each with the MIP start it gets in ``bench.py`` (ours: the gap MILP's plan and our
heuristic starts; dense: our heuristic starts and the fitting baselines' plans), threads 1, gap 0,
once per ``--seeds`` value of HiGHS's ``random_seed`` (single-thread HiGHS times on these cases
swing by 2x with the seed alone, so one run says little). Prints a Markdown table.

    .venv/bin/python benchmarks/root_compare.py --cases rand100@rpi4@0.7@remat --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import make_graph  # noqa: E402

from poet_opt.device.costs import node_costs  # noqa: E402
from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.schedule.decisions import build_steps, totals_of  # noqa: E402
from poet_opt.solver.backends import highs_lp  # noqa: E402
from poet_opt.solver.baselines import run_baselines  # noqa: E402
from poet_opt.solver.dense import DenseFormulation  # noqa: E402
from poet_opt.solver.driver import resolve_budgets  # noqa: E402
from poet_opt.solver.formulation import Formulation  # noqa: E402
from poet_opt.solver.gap_milp import gap_milp_plan  # noqa: E402
from poet_opt.solver.heuristics import starting_points  # noqa: E402


def run_highs(milp, *, relax: bool, start=None, seed: int = 0, time_limit: float = 60.0) -> dict:
    """One HiGHS run with the objective scaled as solvers.solve_milp scales it; figures in joules."""
    import highspy

    scale = 1.0 / max(abs(milp.offset), float(np.abs(milp.c).max(initial=0.0)), 1e-300)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    for key, value in (("mip_rel_gap", 0.0), ("mip_abs_gap", 0.0), ("threads", 1),
                       ("time_limit", float(time_limit)), ("random_seed", int(seed))):
        h.setOptionValue(key, value)
    lp = highs_lp(milp, relax=relax)
    lp.col_cost_, lp.offset_ = milp.c * scale, milp.offset * scale
    h.passModel(lp)
    if start is not None:
        h.setSolution(milp.num_vars, np.arange(milp.num_vars, dtype=np.int32), np.asarray(start, float))
    began = time.perf_counter()
    h.run()
    elapsed = time.perf_counter() - began
    info = h.getInfo()
    out = {"status": h.modelStatusToString(h.getModelStatus()), "s": elapsed}
    if relax:
        out["value"] = info.objective_function_value / scale
    else:
        out.update(obj=info.objective_function_value / scale, bound=info.mip_dual_bound / scale,
                   nodes=info.mip_node_count)
    return out


def energy(graph, costs, d) -> float:
    return totals_of(graph, costs, build_steps(graph, d))["energy_j"]


def compare(case: str, seeds: list[int], time_limit: float) -> list[str]:
    model, device, fraction, mode = case.split("@")
    graph, profile = make_graph(model), load_profile(device)
    costs = node_costs(graph, profile)
    budgets = resolve_budgets(graph, profile, costs, int(float(fraction) * graph.plain_peak_bytes()), None)
    plain = costs.plain_energy_j
    starts = starting_points(graph, costs, budgets, mode)
    ours, dense = Formulation(graph, costs, budgets, mode), DenseFormulation(graph, costs, budgets, mode)
    gap_plan = gap_milp_plan(graph, costs, budgets, mode, time_limit=10, threads=1)
    ours_starts = sorted([d for d in (gap_plan, *starts) if d is not None], key=lambda d: energy(graph, costs, d))
    fitting = [r.decisions for r in run_baselines(graph, profile, costs, budgets).values()
               if r.fits and r.decisions is not None]
    dense_starts = sorted([*starts, *fitting], key=lambda d: energy(graph, costs, d))
    lines = []
    for name, form, cands in (("ours", ours, ours_starts), ("dense", dense, dense_starts)):
        m = form.milp
        x0 = next((x for x in map(form.encode, cands) if x is not None), None)
        start_j = None if x0 is None else float(m.c @ x0 + m.offset)
        lp = run_highs(m, relax=True, time_limit=time_limit)
        runs = [run_highs(m, relax=False, start=x0, seed=s, time_limit=time_limit) for s in seeds]
        times = [r["s"] for r in runs]
        per_seed = ", ".join(f"{r['s']:.1f} s/{r['nodes']} n/{r['status'][:7]}" for r in runs)
        best = min(r["obj"] for r in runs)
        bound = max(r["bound"] for r in runs)
        lines.append(
            f"| {case} | {name} | {m.num_vars} | {int(m.integrality.sum())} | {m.num_rows} | "
            f"{lp['value'] / plain:.6f} | {lp['s']:.2f} | "
            f"{'-' if start_j is None else f'{start_j / plain:.6f}'} | {best / plain:.6f} | {bound / plain:.6f} | "
            f"{statistics.median(times):.1f} | {per_seed} |")
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, help="comma-separated case ids (bench.py --list)")
    ap.add_argument("--seeds", default="0,1,2", help="HiGHS random_seed values, one MILP run each")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args(argv)
    print("| case | model | vars | binaries | rows | root LP / plain | LP s | start / plain | best / plain | "
          "bound / plain | median s | per seed: s / nodes / status |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        compare(case, [int(s) for s in args.seeds.split(",")], args.time_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
