"""What a wear budget costs: Pareto fronts with and without --min-lifetime-steps.

For resnet18-cifar on the Raspberry Pi 4 (SD card), mcu-vww on the nRF52840 (SD card) and mcu-vww on
the STM32F746 (raw QSPI NOR flash, 100,000 erase cycles; paging mode, since the joint plans there do
not page), the same budgets are swept without a wear budget and with one of 100,000 training steps,
and one the medium makes expensive (10,000,000 steps on the Pi's card, 1,000,000 on the NOR flash,
beyond its endurance). Prints one table (energy per point, the ratio, the plan's lifetime) and writes a plot
to docs/wear.png.

    python benchmarks/wear_budget.py          # about 10 minutes on 2 cores
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from poet_opt.pareto import sweep  # noqa: E402
from poet_opt.units import format_bytes  # noqa: E402

CASES = [  # model, device, mode, budgets, wear budgets (steps)
    ("resnet18-cifar", "rpi4", "joint", ["1MiB", "2MiB", "4MiB"], [100_000, 10_000_000]),
    ("mcu-vww", "nrf52840", "joint", ["150KiB", "165KiB", "180KiB"], [100_000]),
    ("mcu-vww", "stm32f746", "paging", ["150KiB", "180KiB", "220KiB"], [100_000, 1_000_000]),
]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    started = time.perf_counter()
    fig, axes = plt.subplots(1, len(CASES), figsize=(5 * len(CASES), 4))
    print(f"{'model':15} {'device':10} {'budget':>8} {'wear budget':>12} {'status':18} {'energy mJ':>10} "
          f"{'x free':>7} {'lifetime steps':>15}")
    for ax, (model, device, mode, rams, wears) in zip(axes, CASES):
        common = dict(modes=(mode,), time_limit=30, jobs=2)
        fronts = {None: sweep(model, device, rams, **common)}
        for steps in wears:
            fronts[steps] = sweep(model, device, rams, min_lifetime_steps=steps, **common)
        free = {r["ram_bytes"]: r for r in fronts[None]}
        for steps, rows in fronts.items():
            solved = [r for r in rows if r["energy_j"] is not None]
            label = "no wear budget" if steps is None else f"survives {steps:,} steps"
            if not solved:  # drawn as nothing: the legend says why
                label += ": no plan at any budget"
            ax.plot([r["ram_bytes"] / 1024 for r in solved], [r["energy_j"] * 1e3 for r in solved],
                    marker="o" if steps is None else "x", linestyle="-" if steps is None else "--", label=label)
            for r in rows:
                base = free.get(r["ram_bytes"])
                ratio = (f"{r['energy_j'] / base['energy_j']:.3f}" if r["energy_j"] is not None and base
                         and base["energy_j"] else "-")
                life = "-" if r["lifetime_steps"] is None else f"{r['lifetime_steps']:,}"
                energy = "-" if r["energy_j"] is None else f"{r['energy_j'] * 1e3:.3f}"
                print(f"{model:15} {device:10} {format_bytes(r['ram_bytes']):>8} "
                      f"{'-' if steps is None else f'{steps:,}':>12} {r['status']:18} {energy:>10} {ratio:>7} "
                      f"{life:>15}", flush=True)
        ax.set_title(f"{model} on {device} ({mode})")
        ax.set_xlabel("RAM budget (KiB)")
        ax.set_ylabel("energy per training step (mJ)")
        ax.legend()
    fig.tight_layout()
    out = ROOT / "docs" / "wear.png"
    fig.savefig(out, dpi=110)
    print(f"\n{time.perf_counter() - started:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
