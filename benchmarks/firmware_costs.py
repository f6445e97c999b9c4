"""Costs from the firmware itself (issue 30, item 3): how well each cost model predicts the step the
emulated core runs, and what the plan becomes when it is solved with measured costs.

For each case: the MILP plan solved with the profile's datasheet costs (what `emulate` runs) is
measured as `poet-opt measure --device` measures it (firmware/step_costs.py: one profiled step,
every node's cycles at the profile's clock), then the plan is solved again with those measured
costs. Every plan (both MILP plans, and checkpoint-all and sqrt(n) where their firmware fits the
device) runs on the emulated core; its step's cycle estimate is a 2-step run less a 1-step run (so
start-up cancels), plus the storage commands it issued at the profile's rates (the emulated card
takes no time; firmware/trainer.py ``storage_bus_s``). The zeroing of the resident weights'
gradients and the SGD update stay in, as they are in every step. Beside it, the plan's runtime as the datasheet costs predict it and as
the measured costs predict it, each as the emulated estimate over the prediction.

    python benchmarks/firmware_costs.py                 # the tables (about a minute on 2 cores)
    python benchmarks/firmware_costs.py --case strip-cnn  # streamed weights, strips, paging
    python benchmarks/firmware_costs.py --case resnet18 --jobs 2  # about an hour: see CASES

The measured-costs plan is solved at the arena budget the datasheet plan was finally solved at:
`emulate` solves again, smaller, when the firmware's other statics and stack leave too little of the
device beside an arena of --ram (ResNet-18 at 200 KiB), and a plan solved at --ram would not fit.
``--jobs N`` runs the emulated steps in N processes (each run is one core's work).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poet_opt.device.costs import node_costs  # noqa: E402
from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import resnet18, strip_cnn, tiny_cnn  # noqa: E402
from poet_opt.firmware.fit import solve_for_export  # noqa: E402
from poet_opt.firmware.step_costs import measure_firmware  # noqa: E402
from poet_opt.model.zoo_twins import zoo_module  # noqa: E402
from poet_opt.firmware.trainer import run_schedule  # noqa: E402
from poet_opt.model.measured_costs import apply_costs, load_costs  # noqa: E402
from poet_opt.schedule.decisions import build_steps, plain_decisions, totals_of  # noqa: E402
from poet_opt.schedule.document import Schedule  # noqa: E402
from poet_opt.solver.baselines import sqrt_n_decisions, without_idle_keeps  # noqa: E402
from poet_opt.solver.driver import resolve_budgets  # noqa: E402
from poet_opt.units import parse_size  # noqa: E402

CASES = {  # name: model, input shape, device, budget
    "mcu-vww": ("mcu-vww", (1, 1, 96, 96), "nrf52840", "150KiB"),
    "mcu-vww-f7": ("mcu-vww", (1, 1, 96, 96), "stm32f746", "150KiB"),
    "tiny-cnn": ("tiny-cnn", (2, 3, 32, 32), "nrf52840", "76KiB"),
    # streamed weights, activation strips and paging: what the emulator leaves out (run on its own)
    "strip-cnn": ("strip-cnn", (1, 1, 96, 96), "nrf52840", "160KiB"),
    # issue 30's ResNet-18 plan, as benchmarks/resnet18_firmware.py runs it (`emulate --torch
    # poet_opt.examples.torch_models:resnet18 --input-shape 1,3,32,32 --device nrf52840 --ram 200KiB`):
    # strips, weight slices, a step program on the card; each emulated step is 18 G instructions,
    # 5-12 minutes of one core, and every plan runs three (the measure, then 1 and 2 steps)
    "resnet18": ("resnet18", (1, 3, 32, 32), "nrf52840", "200KiB"),
}
DEFAULT = ("mcu-vww", "mcu-vww-f7", "tiny-cnn")


def baseline(graph, profile, costs, budgets, decisions, name):
    steps = build_steps(graph, decisions)
    return Schedule(model=graph.name, mode=name, graph=graph, profile=profile, costs=costs, budgets=budgets,
                    decisions=decisions, steps=steps, totals=totals_of(graph, costs, steps), plain={},
                    solver={"status": "baseline"})


_RUNS: dict = {}  # label -> (network, plan, profile, x, y): what a forked worker runs


def _run(label: str, steps: int):
    """(cycles, storage bus seconds) of an emulated run of ``steps`` steps, or the PoetError's message."""
    network, plan, profile, x, y = _RUNS[label]
    try:
        run = run_schedule(network, plan, profile, steps=steps, lr=0.01, x=x, y=y)
    except PoetError as exc:
        return exc.message
    return run.cycles, run.storage_bus_s


def step_runs(plans: dict, profile, x, y, jobs: int) -> dict:
    """label -> a callable giving one step's (core seconds from the cycle estimate, storage seconds of
    the commands it issued at the profile's rates), or raising PoetError: two runs' difference (2
    steps less 1), so start-up is in neither. With ``jobs`` > 1 every run starts now, in forked
    processes, in the plans' order."""
    _RUNS.clear()
    _RUNS.update({label: (net, plan, profile, x, y) for label, (net, plan) in plans.items()})
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
        futures = {(label, n): pool.submit(_run, label, n) for label in plans for n in (2, 1)}
        pool.shutdown(wait=False)
        result = {key: future.result for key, future in futures.items()}
    else:
        result = {(label, n): (lambda label=label, n=n: _run(label, n)) for label in plans for n in (1, 2)}

    def one(label):
        def step():
            runs = [result[label, n]() for n in (1, 2)]
            for run in runs:
                if isinstance(run, str):
                    raise PoetError(run)
            return (runs[1][0] - runs[0][0]) / profile.compute.clock_hz, runs[1][1] - runs[0][1]
        return step

    return {label: one(label) for label in plans}


def run_case(name: str, tmp: Path, jobs: int = 1) -> None:
    model, shape, device, budget = CASES[name]
    module = {"tiny-cnn": tiny_cnn, "strip-cnn": strip_cnn, "resnet18": resnet18}.get(model, lambda: zoo_module(model))()
    profile = load_profile(device)
    ram = parse_size(budget)
    started = time.perf_counter()
    # strip-cnn as docs/firmware.md solves it (its MILP is large); the rest at emulate's default
    limit = 60 if model != "strip-cnn" else 5
    found = measure_firmware(module, shape, device, ram=budget, name=model, time_limit=limit, weights="auto")
    costs_file = tmp / f"{name}.csv"
    costs_file.write_text(found.csv())
    measured = load_costs(costs_file)
    network = found.network  # the datasheet plan's network: the graph the measured costs name
    datasheet_graph = network.graph
    measured_graph = apply_costs(datasheet_graph, measured)
    datasheet_costs, measured_costs = node_costs(datasheet_graph, profile), node_costs(measured_graph, profile)
    plans = {"MILP, datasheet costs": (network, found.plan)}  # the plan measured, as `emulate` runs it
    remeasured = replace(network, graph=measured_graph)
    # at the arena budget the datasheet plan ended at: --ram, or less where the firmware's statics need it
    arena_ram = found.plan.schedule.budgets.ram_bytes
    plans["MILP, measured costs"] = (remeasured, solve_for_export(measured_graph, profile, ram=arena_ram,
                                                                  time_limit=limit))
    limits = resolve_budgets(datasheet_graph, profile, datasheet_costs, ram)
    for label, decisions in (("checkpoint-all", plain_decisions(datasheet_graph)),
                             ("sqrt(n)", without_idle_keeps(datasheet_graph, sqrt_n_decisions(datasheet_graph)))):
        plans[label] = (network, baseline(datasheet_graph, profile, datasheet_costs, limits, decisions, label))
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    y = np.arange(shape[0]) % 2
    print(f"\n{model} on {device} at {budget} ({found.clock_hz / 1e6:g} MHz, {found.power_w * 1e3:.2f} mW active); "
          f"measured in one profiled step: {found.step_cycles:,} cycles, {found.outside_cycles:,} of them outside "
          "the schedule's steps (start-up, gradients zeroed, SGD), not written"
          + (f"; both MILP plans solved for an arena of {arena_ram:,} B" if arena_ram != ram else ""), flush=True)
    runs = step_runs(plans, profile, x, y, jobs)
    header = (f"{'plan':22} {'recomp':>6} {'pgout':>5} {'pred ms (ds)':>12} {'pred ms (meas)':>14} {'storage':>7} "
              f"{'bus ms':>7} {'est ms':>8} {'est/ds':>7} {'est/meas':>8} {'est/cpu':>7} {'pred mJ (ds)':>12} {'pred mJ (meas)':>14}")
    print(header)
    print("-" * len(header))
    for label, (net, plan) in plans.items():
        schedule = plan if isinstance(plan, Schedule) else plan.schedule
        steps = schedule.to_dict()["steps"]
        # both predictions of the same steps (the graphs differ only in their nodes' costs)
        ds = totals_of(datasheet_graph, datasheet_costs, steps)
        ms = totals_of(measured_graph, measured_costs, steps)
        # what the measured file prices (the cores' cycles); the rest is the storage model's
        cpu = sum(measured.rows[datasheet_graph.nodes[st["node"]].name]["time_s"] for st in steps
                  if st["op"] == "compute" and datasheet_graph.nodes[st["node"]].name in measured.rows)
        storage = ms["runtime_s"] - cpu
        storage = 0.0 if abs(storage) < 1e-9 else storage  # sums in another order: no "-0.0"
        try:
            core_s, bus_s = runs[label]()
            est = core_s + bus_s
        except PoetError as exc:
            print(f"{label:22} {ds['recomputes']:6d} {ds['page_outs']:5d} {ds['runtime_s'] * 1e3:12.1f} "
                  f"{ms['runtime_s'] * 1e3:14.1f} {storage * 1e3:7.1f}  does not run: {exc.message[:60]}")
            continue
        print(f"{label:22} {ds['recomputes']:6d} {ds['page_outs']:5d} {ds['runtime_s'] * 1e3:12.1f} "
              f"{ms['runtime_s'] * 1e3:14.1f} {storage * 1e3:7.1f} {bus_s * 1e3:7.1f} {est * 1e3:8.1f} "
              f"{est / ds['runtime_s']:7.3f} {est / ms['runtime_s']:8.3f} {core_s / cpu:7.3f} {ds['energy_j'] * 1e3:12.3f} "
              f"{ms['energy_j'] * 1e3:14.3f}", flush=True)
    a, b = plans["MILP, datasheet costs"][1].schedule, plans["MILP, measured costs"][1].schedule
    changed = [n for n, (p, q) in enumerate(zip(a.to_dict()["steps"], b.to_dict()["steps"])) if p != q]
    print(f"re-solved with measured costs: {a.totals['recomputes']} -> {b.totals['recomputes']} recomputations, "
          f"{a.totals['page_outs']} -> {b.totals['page_outs']} page-outs, "
          f"{'the same steps' if not changed and len(a.to_dict()['steps']) == len(b.to_dict()['steps']) else 'other steps'}"
          f"; solver {a.solver['status']} -> {b.solver['status']}; "
          f"{time.perf_counter() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help=f"default: {', '.join(DEFAULT)} (strip-cnn takes about 5 minutes, resnet18 an hour)")
    parser.add_argument("--jobs", type=int, default=1, help="emulated runs at once, in forked processes")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.case or DEFAULT:
            run_case(name, Path(tmp), args.jobs)
    print("\n'ds': the profile's datasheet costs (FLOPs at its rate); 'meas': the costs `poet-opt measure --device` "
          "writes for the MILP's datasheet plan; 'est': the emulator's cycle estimate of one step "
          "(poet_opt/firmware/cycles.py) at the profile's clock, a 2-step run less a 1-step run, plus 'bus': the "
          "storage commands the firmware issued in that step at the profile's latencies and rates (the emulated "
          "card answers at once). 'storage': the ms of 'pred (meas)' that the profile's storage model prices "
          "(paging, streamed weights' reads and write-backs); 'est/cpu' is the core's part of 'est' over the rest.")


if __name__ == "__main__":
    main()
