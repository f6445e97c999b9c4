"""The energy-memory Pareto front of a sweep, as a picture."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from poet_opt.pareto.table import INFEASIBLE, SOLVED
from poet_opt.plots.style import bytes_axis, energy_unit, pyplot, save_figure
from poet_opt.schedule.document import PROVEN_STATUSES
from poet_opt.units import format_bytes


def plot_front(rows: Sequence[dict], path) -> list[Path]:
    """Energy per training step against the RAM budget, one line per (device, mode).

    Solved points are joined by a line (hollow markers: not proven optimal); infeasible budgets are
    crosses on the axis with the region below the smallest feasible budget shaded; the smallest
    feasible budget is annotated; plain training (its peak RAM and energy) is a star. Writes PNG and
    SVG (``path`` without suffix or ending .svg) or PNG only (``path`` ending .png); returns the
    files written."""
    plt = pyplot()
    rows = list(rows)
    series: dict = {}
    for row in rows:
        series.setdefault((row["device"], row["mode"]), []).append(row)
    energies = [r["energy_j"] for r in rows if r.get("energy_j") is not None]
    energies += [r["plain_energy_j"] for r in rows if r.get("plain_energy_j") is not None]
    scale, unit = energy_unit(energies)
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    floor = min(energies) / scale if energies else 0.0
    for k, ((device, mode), members) in enumerate(series.items()):
        color = colors[k % len(colors)]
        members = sorted(members, key=lambda r: r["ram_bytes"])
        solved = [r for r in members if r["status"] in SOLVED and r.get("energy_j") is not None]
        label = f"{device} ({mode})"
        if solved:
            xs = [r["ram_bytes"] for r in solved]
            ys = [r["energy_j"] / scale for r in solved]
            ax.plot(xs, ys, "-", color=color, label=label)
            for r, x, y in zip(solved, xs, ys):
                proven = r["status"] in PROVEN_STATUSES  # hollow: stopped before the requested gap
                ax.plot([x], [y], "o", color=color, markerfacecolor=color if proven else "white")
        else:
            ax.plot([], [], "-", color=color, label=label)
        infeasible = [r for r in members if r["status"] in INFEASIBLE]
        if infeasible:
            xs = [r["ram_bytes"] for r in infeasible]
            ax.plot(xs, [floor] * len(xs), "x", color=color, markersize=8)
            mins = [r["min_feasible_ram_bytes"] for r in infeasible if r.get("min_feasible_ram_bytes")]
            if mins:  # a solved point's own peak can undercut a time-limited minimum-peak search
                mins += [r["peak_ram_bytes"] for r in solved if r.get("peak_ram_bytes")]
            # proven infeasible: up to the largest infeasible budget, or the smallest feasible one
            edge = min(mins) if mins else max(xs)
            ax.axvspan(min(xs) * 0.97, edge, color=color, alpha=0.08, lw=0)
            if mins:
                m = min(mins)
                ax.axvline(m, color=color, ls=":", lw=1)
                ax.annotate(f"min feasible {format_bytes(m)}", xy=(m, floor), xytext=(4, 12),
                            textcoords="offset points", color=color, fontsize=8, rotation=90, va="bottom")
        plain = next((r for r in members if r.get("plain_energy_j") is not None), None)
        if plain is not None:
            ax.plot([plain["plain_peak_bytes"]], [plain["plain_energy_j"] / scale], "*", color=color, markersize=13,
                    markeredgecolor="black", markeredgewidth=0.5)
    if rows:
        ax.plot([], [], "*", color="grey", markeredgecolor="black", label="plain training (peak RAM)")
        if any(r["status"] in INFEASIBLE for r in rows):
            ax.plot([], [], "x", color="grey", label="infeasible budget")
    model = rows[0]["model"] if rows else ""
    runtime = next((r["runtime_budget_s"] for r in rows if r.get("runtime_budget_s") is not None), None)
    ax.set_title(f"{model}: energy per training step vs RAM budget"
                 + ("" if runtime is None else " (runtime budget applied)"))
    ax.set_xlabel("RAM budget for activations and gradients")
    ax.set_ylabel(f"energy per training step ({unit})")
    positive = [e / scale for e in energies if e > 0]
    if positive and max(positive) > 8 * min(positive):
        # devices an order of magnitude apart would flatten each other's curves on a linear axis
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_yscale("log")
        label = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_formatter(label)
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(label)
        ax.set_ylabel(f"energy per training step ({unit}, log scale)")
    bytes_axis(ax, "x")
    ax.grid(True, alpha=0.3)
    if rows:
        ax.legend(fontsize=8, loc="best")
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)
