"""Emulated cost of one training step: the MILP's plan against checkpoint-all and sqrt(n).

For mcu-vww and the example CNN (poet_opt.examples.torch_models:tiny_cnn) on the nRF52840 and the
STM32F746, at two RAM budgets each, every plan is generated into firmware and run on the emulated
Cortex-M; the instructions of one training step are the difference between a 2-step and a 1-step
run (so reset and start-up cancel), with the emulator's cycle estimate of the same step. Beside
them: the energy and runtime the profile predicts for the plan, and how instructions and
predicted runtime agree, as instructions per predicted second relative to the MILP plan of the
same case (1.00 = the cost model ranks the plans as the emulator does), and the cycle estimate
in milliseconds at the profile's clock against the predicted runtime, absolute.

    python benchmarks/firmware_steps.py            # the table (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poet_opt.device.costs import node_costs  # noqa: E402
from poet_opt.device.profiles import load_profile  # noqa: E402
from poet_opt.errors import PoetError  # noqa: E402
from poet_opt.examples.torch_models import tiny_cnn  # noqa: E402
from poet_opt.firmware.fit import solve_for_export  # noqa: E402
from poet_opt.model.network import lower_network  # noqa: E402
from poet_opt.model.zoo_twins import zoo_module  # noqa: E402
from poet_opt.firmware.trainer import run_schedule  # noqa: E402
from poet_opt.schedule.decisions import build_steps, plain_decisions, totals_of  # noqa: E402
from poet_opt.schedule.document import Schedule  # noqa: E402
from poet_opt.solver.baselines import sqrt_n_decisions, without_idle_keeps  # noqa: E402
from poet_opt.solver.driver import resolve_budgets  # noqa: E402
from poet_opt.units import parse_size  # noqa: E402

CASES = [  # model, input shape, device, budgets
    ("mcu-vww", (1, 1, 96, 96), "nrf52840", ("150KiB", "165KiB")),
    ("mcu-vww", (1, 1, 96, 96), "stm32f746", ("150KiB", "200KiB")),
    ("tiny-cnn", (2, 3, 32, 32), "nrf52840", ("76KiB", "90KiB")),
    ("tiny-cnn", (2, 3, 32, 32), "stm32f746", ("76KiB", "90KiB")),
]


def baseline_schedule(graph, profile, costs, budgets, decisions, name):
    steps = build_steps(graph, decisions)
    return Schedule(model=graph.name, mode=name, graph=graph, profile=profile, costs=costs, budgets=budgets,
                    decisions=decisions, steps=steps, totals=totals_of(graph, costs, steps), plain={},
                    solver={"status": "baseline"})


def step_instructions(network, plan, profile, x, y) -> tuple[int, int]:
    """Instructions and estimated cycles of one step: a 2-step run less a 1-step run."""
    runs = [run_schedule(network, plan, profile, steps=n, lr=0.01, x=x, y=y) for n in (1, 2)]
    return runs[1].instructions - runs[0].instructions, runs[1].cycles - runs[0].cycles


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(0)
    header = (f"{'model':9} {'device':9} {'budget':>7} {'plan':15} {'arena KiB':>9} {'pred mJ':>9} {'pred ms':>9} "
              f"{'M instr':>9} {'instr/MILP':>10} {'pred/MILP':>9} {'agree':>6} {'est ms':>8} {'est/pred':>8}  budget")
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    for model, shape, device, budgets in CASES:
        module = zoo_module(model) if model != "tiny-cnn" else tiny_cnn()
        network = lower_network(module, shape, name=model)
        x = rng.standard_normal(shape).astype(np.float32)
        y = np.arange(shape[0]) % 2
        profile = load_profile(device)
        costs = node_costs(network.graph, profile)
        for budget in budgets:
            ram = parse_size(budget)
            plans = {"MILP (joint)": solve_for_export(network.graph, profile, ram=ram, time_limit=60)}
            limits = resolve_budgets(network.graph, profile, costs, ram)
            for name, decisions in (("checkpoint-all", plain_decisions(network.graph)),
                                    ("sqrt(n)", without_idle_keeps(network.graph, sqrt_n_decisions(network.graph)))):
                plans[name] = baseline_schedule(network.graph, profile, costs, limits, decisions, name)
            reference = None
            for name, plan in plans.items():
                schedule = plan if isinstance(plan, Schedule) else plan.schedule
                totals = schedule.totals
                try:
                    instructions, cycles = step_instructions(network, plan, profile, x, y)
                except PoetError as exc:
                    print(f"{model:9} {device:9} {budget:>7} {name:15} does not run: {exc.message[:70]}")
                    continue
                if reference is None:
                    reference = (instructions, totals["runtime_s"])
                arena_kib = (plan.arena.arena_bytes if not isinstance(plan, Schedule) else
                             totals["peak_ram_bytes"]) / 1024
                instr_ratio = instructions / reference[0]
                pred_ratio = totals["runtime_s"] / reference[1]
                print(f"{model:9} {device:9} {budget:>7} {name:15} {arena_kib:9.1f} {totals['energy_j'] * 1e3:9.3f} "
                      f"{totals['runtime_s'] * 1e3:9.1f} {instructions / 1e6:9.2f} {instr_ratio:10.3f} "
                      f"{pred_ratio:9.3f} {instr_ratio / pred_ratio:6.2f} {cycles / profile.compute.clock_hz * 1e3:8.1f} "
                      f"{cycles / profile.compute.clock_hz / totals['runtime_s']:8.2f}  "
                      f"{'within' if totals['peak_ram_bytes'] <= ram else 'OVER'}", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s. 'arena KiB' of a baseline is its live peak (the arena is laid out "
          "at run time); a plan whose static data and stack exceed the device's RAM does not run; 'budget' says "
          "whether the plan's live peak meets the RAM budget of the row (a baseline over it runs only because "
          "the device has RAM to spare beyond the budget). 'est ms' is the emulator's cycle estimate of one step at "
          "the profile's clock (poet_opt/firmware/cycles.py), 'est/pred' that over the profile's predicted runtime.")


if __name__ == "__main__":
    main()
