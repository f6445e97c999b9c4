"""Issue 5's benchmark suite: our solver, the dense POET/Checkmate formulation and the heuristic
baselines, side by side in one run (run by hand, not in CI).

For each case (model x device x RAM budget as a fraction of the plain-training peak x mode):

- ``ours``: :func:`poet_opt.solver.driver.solve` (our reduced formulation, heuristic MIP start, validated);
- ``poet-dense`` (joint cases) or ``checkmate-dense`` (remat cases): :mod:`poet_opt.solver.dense` in the
  published POET semantics, same solver, threads, gap and time limit, as published: no MIP start;
  its plan is replayed and checked by our validator;
- ``poet-dense+starts`` / ``checkmate-dense+starts``: the same model given a MIP start, the
  cheapest its rows accept among our heuristic starts and the fitting baselines' plans (MIP starts
  are one of our solver's tools; this row shows what the formulation alone is worth);
- ``checkpoint-all``, ``sqrt-n``, ``dtr``: :mod:`poet_opt.solver.baselines`, judged by our cost model.

Budgets: RAM as given; no runtime budget unless ``--runtime`` (then the dense model counts paging
time too, as ours does, unless ``--dense-runtime compute``: POET's own accounting). Writes a CSV
and a Markdown table (rewritten after every case, so a long run keeps what it has measured).
Exits non-zero, with a FAIL line each, where ours spends more energy than a heuristic baseline
that fits the budget, or more than a dense model that proved its optimum (beyond 1e-6 relative).

    .venv/bin/python benchmarks/bench.py --list
    .venv/bin/python benchmarks/bench.py                                     # the whole suite, 600 s a solve
    .venv/bin/python benchmarks/bench.py --cases 'resnet18-cifar@rpi4@*' --time-limit 60 --threads 2
    .venv/bin/python benchmarks/bench.py --cases 'rand100@*' --time-limit 300 --jobs 2   # two cases at once
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from poet_opt.device.costs import node_costs
from poet_opt.device.profiles import load_profile
from poet_opt.errors import InfeasibleError, NoScheduleFound
from poet_opt.files import write_text_atomic
from poet_opt.model.random_graph import random_training_graph
from poet_opt.model.zoo import build_model
from poet_opt.schedule.decisions import build_steps, totals_of
from poet_opt.solver.baselines import run_baselines
from poet_opt.solver.dense import solve_dense
from poet_opt.solver.driver import resolve_budgets, solve
from poet_opt.solver.heuristics import starting_points

HERE = Path(__file__).resolve().parent
FRACTIONS = (0.9, 0.7, 0.5, 0.35)
ZOO = ("resnet18-cifar", "vgg16-cifar", "mobilenetv2", "resnet50", "bert-base", "transformer-block")
# random graphs of 100, 300 and 1000 nodes (n_forward forward nodes, as many gradients), seed 1
RANDOM = {"rand100": 50, "rand300": 150, "rand1000": 500}
DEVICES = ("rpi4", "jetson-nano")
MCU = "nrf52840"
MCU_MODELS = ("mcu-vww", "rand100")
REL = 1e-6


def make_graph(model: str):
    if model in RANDOM:
        return random_training_graph(RANDOM[model], seed=1)
    return build_model(model)


def suite() -> list[str]:
    """Case ids model@device@fraction@mode. Joint mode everywhere; remat-only (the Checkmate
    comparison) on the Pi 4; the MCU for the small models."""
    cases = []
    models = (*ZOO, *RANDOM)
    for model in models:
        for device in DEVICES:
            cases += [f"{model}@{device}@{f}@joint" for f in FRACTIONS]
    for model in MCU_MODELS:
        cases += [f"{model}@{MCU}@{f}@joint" for f in FRACTIONS]
    for model in models:
        cases += [f"{model}@rpi4@{f}@remat" for f in FRACTIONS]
    return cases


def run_ours(graph, profile, ram, runtime, mode, args) -> dict:
    started = time.perf_counter()
    try:
        s = solve(graph, profile, ram=ram, runtime=runtime, mode=mode, time_limit=args.time_limit,
                  threads=args.threads, gap=args.gap)
    except InfeasibleError as exc:
        return {"status": "infeasible", "note": exc.message, "wall_s": time.perf_counter() - started}
    except NoScheduleFound as exc:
        return {"status": "no_solution", "note": exc.message, "wall_s": time.perf_counter() - started}
    t = s.totals
    return {"status": s.solver["status"], "energy_j": t["energy_j"], "runtime_s": t["runtime_s"],
            "peak_bytes": t["peak_ram_bytes"], "gap": s.solver["gap"], "bound_j": s.solver["bound"],
            "build_s": s.solver["build_s"], "solve_s": s.solver["solve_s"], "fits": True,
            "vars": s.solver["variables"], "wall_s": time.perf_counter() - started,
            "note": f"{t['recomputes']} recomputes, {t['page_outs']} page-outs, {t['page_ins']} page-ins"}


def run_dense(graph, profile, costs, budgets, mode, args, baselines, with_starts: bool) -> dict:
    started = time.perf_counter()
    starts = None
    if with_starts:
        # Our heuristic MIP starts, then the baselines that fit, cheapest first: under POET's paging
        # semantics the dense rows reject our same-stage page-ins, and a start is what gives a MILP of
        # this size any incumbent within the time limit. Ours does not get the baselines.
        starts = starting_points(graph, costs, budgets, mode)
        starts += [r.decisions for r in baselines.values() if r.fits and r.decisions is not None]
        starts.sort(key=lambda d: totals_of(graph, costs, build_steps(graph, d))["energy_j"])
    out = solve_dense(graph, profile, costs, budgets, mode, semantics="poet", runtime=args.dense_runtime,
                      time_limit=args.time_limit, gap=args.gap, threads=args.threads,
                      start=starts)
    row = {"status": out.status, "gap": out.gap, "bound_j": out.bound, "build_s": out.build_s,
           "solve_s": out.solve_s, "vars": out.num_vars, "wall_s": time.perf_counter() - started,
           "objective_j": out.objective}
    if out.replay is not None:
        t = out.replay
        row.update(energy_j=t["energy_j"], runtime_s=t["runtime_s"], peak_bytes=t["peak_ram_bytes"], fits=True)
        notes = [f"{t['recomputes']} recomputes, {t['page_outs']} page-outs, {t['page_ins']} page-ins"]
        if out.mapped is not None:
            notes.append(f"as our decisions {out.mapped['energy_j']:.6g} J")
        elif out.mapped_note:
            notes.append(f"not expressible as ours: {out.mapped_note}")
        if with_starts:
            notes.append("MIP start: " + ("taken" if out.had_start else "none its rows accept"))
        row["note"] = "; ".join(notes)
    elif out.objective is not None:
        row.update(energy_j=out.objective, fits=False, note=f"plan fails our validator: {out.replay_error}")
    return row


def run_case(case: str, args) -> list[dict]:
    model, device, fraction, mode = case.split("@")
    graph = make_graph(model)
    profile = load_profile(device)
    costs = node_costs(graph, profile)
    plain_peak = graph.plain_peak_bytes()
    ram = int(float(fraction) * plain_peak)
    base = {"case": case, "model": model, "device": device, "fraction": float(fraction), "mode": mode,
            "nodes": len(graph), "edges": len(graph.edges), "ram_bytes": ram,
            "plain_energy_j": costs.plain_energy_j, "plain_runtime_s": costs.plain_runtime_s}
    rows = []
    if ram < graph.min_working_set_bytes():
        rows.append({**base, "method": "ours", "status": "infeasible",
                     "note": f"below the smallest working set {graph.min_working_set_bytes()} B"})
        return rows
    budgets = resolve_budgets(graph, profile, costs, ram, args.runtime)
    print(f"[{time.strftime('%H:%M:%S')}] {case}: T={len(graph)}", file=sys.stderr, flush=True)
    baselines = run_baselines(graph, profile, costs, budgets)
    rows.append({**base, "method": "ours", **run_ours(graph, profile, ram, args.runtime, mode, args)})
    if not args.no_dense and mode in ("joint", "remat"):
        name = "poet-dense" if mode == "joint" else "checkmate-dense"
        # As published (no MIP start: POET's and Checkmate's code have none), and with our heuristic
        # starts, which are one of our solver's own tools: the second shows what the formulation
        # alone is worth.
        for with_starts in {"none": (False,), "ours": (True,), "both": (False, True)}[args.dense_starts]:
            rows.append({**base, "method": name + (STARTS_SUFFIX if with_starts else ""),
                         **run_dense(graph, profile, costs, budgets, mode, args, baselines, with_starts)})
    for name, r in baselines.items():
        row = {**base, "method": name, "status": "fits" if r.fits else ("no plan" if r.totals is None else "over budget"),
               "fits": r.fits, "note": r.note}
        if r.totals is not None:
            t = r.totals
            row.update(energy_j=t["energy_j"], runtime_s=t["runtime_s"], peak_bytes=t["peak_ram_bytes"])
        rows.append(row)
    dense = next((r for r in rows if _is_published_dense(r["method"])), None)
    seeded = next((r for r in rows if _is_seeded_dense(r["method"])), None)
    for r in rows:
        if dense is not None and dense.get("energy_j") is not None and r.get("energy_j") is not None:
            r["energy_vs_dense"] = r["energy_j"] / dense["energy_j"]
        for ref, key in ((dense, "dense_solve_ratio"), (seeded, "dense_starts_solve_ratio")):
            if r is not ref and ref is not None and r.get("solve_s") and ref.get("solve_s") is not None:
                r[key] = ref["solve_s"] / r["solve_s"]
    return rows


STARTS_SUFFIX = "+starts"


def _is_published_dense(method: str) -> bool:
    return method.endswith("-dense")


def _is_seeded_dense(method: str) -> bool:
    return method.endswith("-dense" + STARTS_SUFFIX)


def _is_dense(method: str) -> bool:
    return _is_published_dense(method) or _is_seeded_dense(method)


def check(rows: list[dict]) -> list[str]:
    """The issue's assertions on one case's rows."""
    fails = []
    ours = next(r for r in rows if r["method"] == "ours")
    e = ours.get("energy_j")
    for r in rows:
        if r["method"] in ("checkpoint-all", "sqrt-n", "dtr") and r.get("fits"):
            if e is None:
                fails.append(f"FAIL {r['case']}: {r['method']} fits ({r['energy_j']:.9g} J) but ours found no "
                             f"schedule ({ours['status']})")
            elif e > r["energy_j"] * (1 + REL):
                fails.append(f"FAIL {r['case']}: ours {e:.9g} J > {r['method']} {r['energy_j']:.9g} J "
                             f"({e / r['energy_j']:.6f}x)")
        if _is_dense(r["method"]) and r.get("status") == "optimal" and r.get("fits"):
            if e is None or e > r["energy_j"] * (1 + REL):
                got = "no schedule" if e is None else f"{e:.9g} J"
                fails.append(f"FAIL {r['case']}: ours {got} > {r['method']} proven optimum {r['energy_j']:.9g} J")
    return fails


COLUMNS = ("case", "method", "status", "energy_j", "runtime_s", "peak_bytes", "gap", "build_s", "solve_s",
           "energy_vs_dense", "dense_solve_ratio", "dense_starts_solve_ratio", "fits", "bound_j", "objective_j",
           "vars", "wall_s",
           "model", "device", "fraction", "mode", "nodes", "edges", "ram_bytes", "plain_energy_j",
           "plain_runtime_s", "note")


def write_csv(rows, path: Path):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    write_text_atomic(buf.getvalue(), path)


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def machine_facts() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import highspy

        highs = getattr(highspy, "__version__", None) or subprocess.run(
            [sys.executable, "-m", "pip", "show", "highspy"], capture_output=True, text=True).stdout.split(
            "Version: ")[1].split()[0]
    except Exception:
        highs = "?"
    try:
        git = ["git", "-C", str(HERE.parent)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            raise OSError("not a git checkout")
        commit = head.stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "poet_opt"], capture_output=True,
                               text=True).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
        code = commit + (f" plus uncommitted changes to {', '.join(dirty)}" if dirty else "")
    except OSError:
        code = f"{HERE.parent} (not a git checkout)"
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "highspy": highs,
            "host": platform.node(), "code": code}


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for label, is_ref in (("the dense formulation as published (no MIP start)", _is_published_dense),
                          ("the dense formulation given our MIP starts", _is_seeded_dense)):
        if any(is_ref(r["method"]) for r in rows):
            lines.append(f"Against {label}:")
            lines += ["  " + line for line in _summary_against(rows, is_ref)]
    return lines or ["- No dense runs."]


def _summary_against(rows: list[dict], is_ref) -> list[str]:
    lines = []
    by_case: dict[str, list[dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    ratios, total_ratios, cmp = [], [], {"lower": [], "equal": [], "higher": []}
    ours_only = []
    for case, rs in by_case.items():
        ours = next((r for r in rs if r["method"] == "ours"), None)
        dense = next((r for r in rs if is_ref(r["method"])), None)
        if ours is None or dense is None:
            continue
        if ours.get("status") == "optimal" and dense.get("status") == "optimal":
            ratios.append((dense["solve_s"] / max(ours["solve_s"], 1e-9), case))
            total_ratios.append(((dense["solve_s"] + dense["build_s"]) /
                                 max(ours["solve_s"] + ours["build_s"], 1e-9), case))
        elif ours.get("status") == "optimal":
            ours_only.append(f"{case} (dense: {dense.get('status')}, gap {_pct(dense.get('gap'))})")
        if ours.get("energy_j") is not None and dense.get("energy_j") is not None and dense.get("fits"):
            rel = ours["energy_j"] / dense["energy_j"] - 1
            key = "lower" if rel < -REL else ("higher" if rel > REL else "equal")
            cmp[key].append(f"{case} ({100 * rel:+.4f}%, dense {dense.get('status')})")
    if ratios:
        vals = [r for r, _ in ratios]
        worst = min(ratios)
        lines.append(f"- Cases where both prove the optimum: {len(ratios)}. Solve-time ratio dense/ours: "
                     f"median {statistics.median(vals):.1f}x, worst {worst[0]:.1f}x ({worst[1]}), "
                     f"best {max(ratios)[0]:.1f}x ({max(ratios)[1]}). Build + solve: median "
                     f"{statistics.median([r for r, _ in total_ratios]):.1f}x, worst {min(total_ratios)[0]:.1f}x.")
    else:
        lines.append("- No case where both prove the optimum within the time limit.")
    if ours_only:
        lines.append(f"- Ours proves the optimum, the dense model does not within the time limit: "
                     f"{len(ours_only)}: " + "; ".join(ours_only) + ".")
    lines.append(f"- Energy, ours vs the dense model's plan (validated replay): lower on {len(cmp['lower'])}, equal "
                 f"(1e-6) on {len(cmp['equal'])}, higher on {len(cmp['higher'])} case(s).")
    for key in ("lower", "higher"):
        if cmp[key]:
            lines.append(f"  - {key}: " + "; ".join(cmp[key]))
    return lines


def _pct(v):
    return "-" if v is None else f"{100 * v:.2f}%"


def write_markdown(rows, fails, args, facts, started, path: Path, done: bool):
    out = ["# Benchmark results (issue 5)", ""]
    if args.note:
        out += [f"**{args.note}**", ""]
    out += [f"- Machine: `nproc` = {facts['nproc']}, CPU: {facts['cpu']}, host {facts['host']}; Python "
            f"{facts['python']}, highspy {facts['highspy']}; code: {facts['code']}.",
            f"- Date: {started} (UTC){'' if done else ', run still in progress when this was written'}.",
            f"- Command: `{' '.join(['benchmarks/bench.py', *sys.argv[1:]])}`",
            f"- Time limit {args.time_limit:g} s per solve, threads {args.threads}, {args.jobs} case(s) at a time, "
            f"relative gap {args.gap:g}, "
            f"runtime budget {args.runtime or 'none'} (dense runtime accounting: {args.dense_runtime}).",
            "- Budgets: RAM = fraction x plain-training peak of working memory; energy, runtime and peak of every "
            "plan are our cost model's figures on its validated replay. `poet-dense` / `checkmate-dense` = POET's "
            "published formulation (Checkmate's for remat cases), built in bulk, as published: no MIP start. "
            "`...-dense+starts` = the same model given our heuristic MIP starts and the fitting baselines' plans as "
            "MIP start candidates (the cheapest its rows accept).",
            "- ratio columns: E/E_dense = energy relative to the dense model's plan (as published); t_dense/t = "
            "its solve seconds over this method's; t_dense+s/t = the same for the dense model given our starts.", ""]
    out += ["## Summary", ""] + summary(rows)
    out += ["", "Assertions (ours <= every heuristic baseline that fits; ours <= a dense proven optimum): "
            + ("all hold." if not fails else f"{len(fails)} FAIL(s):")]
    out += [f"- {f}" for f in fails]
    out += ["", "## Table", "",
            "| case | T | method | status | energy J | E/plain | runtime/plain | peak/budget | gap | build s | "
            "solve s | E/E_dense | t_dense/t | t_dense+s/t | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plain_j, plain_s = r.get("plain_energy_j"), r.get("plain_runtime_s")
        cells = (r["case"], r.get("nodes", ""), r["method"], r.get("status", ""), _f(r.get("energy_j"), ".6g"),
                 _f(r["energy_j"] / plain_j if r.get("energy_j") is not None and plain_j else None, ".5f"),
                 _f(r["runtime_s"] / plain_s if r.get("runtime_s") is not None and plain_s else None, ".4f"),
                 _f(r["peak_bytes"] / r["ram_bytes"] if r.get("peak_bytes") is not None else None, ".3f"),
                 _pct(r.get("gap")), _f(r.get("build_s"), ".2f"), _f(r.get("solve_s"), ".2f"),
                 _f(r.get("energy_vs_dense"), ".6f"), _f(r.get("dense_solve_ratio"), ".1f"),
                 _f(r.get("dense_starts_solve_ratio"), ".1f"),
                 (r.get("note") or "").replace("|", "/"))
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    write_text_atomic("\n".join(out) + "\n", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="*", help="comma-separated glob patterns over case ids (see --list), run in that order")
    ap.add_argument("--list", action="store_true", help="print the case ids and exit")
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds per solve (default 600)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gap", type=float, default=0.0, help="relative gap for every MILP (default 0: prove it)")
    ap.add_argument("--runtime", default=None, help="runtime budget for every case, e.g. 1.2x (default none)")
    ap.add_argument("--dense-runtime", choices=("all", "compute"), default="all",
                    help="the dense model's runtime row: all step times (ours) or compute only (POET)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense formulation")
    ap.add_argument("--dense-starts", choices=("none", "ours", "both"), default="both",
                    help="run the dense model as published (none), given our MIP starts (ours), or both (default)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="cases run at once, one worker process each (default 1); use at most one per core")
    ap.add_argument("--csv", type=Path, default=HERE / "results.csv")
    ap.add_argument("--md", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--note", default="", help="a line for the top of RESULTS.md (e.g. what kind of run)")
    args = ap.parse_args(argv)

    patterns = [p.strip() for p in args.cases.split(",") if p.strip()]
    # in the order of the patterns given, so a long run can put the cases that matter most first
    cases = list(dict.fromkeys(c for p in patterns for c in suite() if fnmatch.fnmatchcase(c, p)))
    if args.list:
        print("\n".join(suite()))
        return 0
    if not cases:
        print(f"no case matches {args.cases!r}; see --list", file=sys.stderr)
        return 2
    facts = machine_facts()
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    by_case: dict[str, list[dict]] = {}
    fails = []

    def record(case, case_rows):
        by_case[case] = case_rows
        new = check(case_rows)
        fails.extend(new)
        for line in new:
            print(line, flush=True)
        for r in case_rows:
            print(f"  {case} {r['method']:16s} {r.get('status', ''):12s} E={_f(r.get('energy_j'), '.6g'):>12s} "
                  f"gap={_pct(r.get('gap')):>7s} build={_f(r.get('build_s'), '.2f'):>6s} "
                  f"solve={_f(r.get('solve_s'), '.2f'):>7s}", file=sys.stderr, flush=True)
        done_rows = [r for c in cases if c in by_case for r in by_case[c]]  # suite order, whatever finished
        write_csv(done_rows, args.csv)
        write_markdown(done_rows, fails, args, facts, started, args.md, done=False)
        return done_rows

    rows: list[dict] = []
    if args.jobs > 1:
        # One case per worker process at a time; within a case ours, the dense model and the baselines
        # still run one after the other, so each ratio compares solves under the same load.
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(run_case, case, args): case for case in cases}
            for future in as_completed(futures):
                rows = record(futures[future], future.result())
    else:
        for case in cases:
            rows = record(case, run_case(case, args))
    write_markdown(rows, fails, args, facts, started, args.md, done=True)
    for line in summary(rows):
        print(line)
    if fails:
        print(f"{len(fails)} assertion(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
