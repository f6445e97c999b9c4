"""The energy-memory Pareto front of a sweep, as a picture."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from poet_opt.pareto.table import INFEASIBLE, SOLVED
from poet_opt.plots.style import bytes_axis, energy_unit, pyplot, save_figure, size_text
from poet_opt.schedule.document import PROVEN_STATUSES


# a line style per mode: series of one device in two modes often coincide, and a dashed line over a
# wider solid one keeps both visible
MODE_STYLE = {"joint": "-", "paging": "--", "remat": "-.", "none": ":"}


def plot_front(rows: Sequence[dict], path) -> list[Path]:
    """Energy per training step against the RAM budget, one line per (device, mode).

    Solved points are joined by a line (hollow markers: not proven optimal); infeasible budgets are
    crosses along the bottom edge with the region below the smallest feasible budget shaded; the
    smallest feasible budget is a dotted line, annotated; plain training (its peak RAM and energy) is
    a star. Every kind of mark, band and line drawn has a legend entry (grey: the same for every
    series), and only those drawn. Writes PNG and SVG (``path`` without suffix or ending .svg) or PNG
    only (``path`` ending .png); returns the files written."""
    fig = front_figure(rows)
    try:
        return save_figure(fig, path)
    finally:
        pyplot().close(fig)


def front_figure(rows: Sequence[dict]):
    """The figure ``plot_front`` saves (tests read its legend)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt = pyplot()
    rows = list(rows)
    series: dict = {}
    for row in rows:
        series.setdefault((row["device"], row["mode"]), []).append(row)
    energies = [r["energy_j"] for r in rows if r.get("energy_j") is not None]
    energies += [r["plain_energy_j"] for r in rows if r.get("plain_energy_j") is not None]
    scale, unit = energy_unit(energies)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn: set[str] = set()  # the kinds of mark actually drawn, for the legend's key
    for k, ((device, mode), members) in enumerate(series.items()):
        color = colors[k % len(colors)]
        members = sorted(members, key=lambda r: r["ram_bytes"])
        solved = [r for r in members if r["status"] in SOLVED and r.get("energy_j") is not None]
        label = f"{device} ({mode})"
        if solved:
            xs = [r["ram_bytes"] for r in solved]
            ys = [r["energy_j"] / scale for r in solved]
            ax.plot(xs, ys, MODE_STYLE.get(mode, "-"), color=color, label=label, lw=2.2 if mode == "joint" else 1.4)
            for r, x, y in zip(solved, xs, ys):
                proven = r["status"] in PROVEN_STATUSES  # hollow: stopped before the requested gap
                drawn.add("proven" if proven else "time_limit")
                ax.plot([x], [y], "o", color=color, markerfacecolor=color if proven else "white")
        else:
            ax.plot([], [], MODE_STYLE.get(mode, "-"), color=color, label=label)
        infeasible = [r for r in members if r["status"] in INFEASIBLE]
        if infeasible:
            drawn.add("infeasible")
            xs = [r["ram_bytes"] for r in infeasible]
            # on the bottom edge (axes coordinates), one row per series so that crosses of two
            # series at the same budget do not hide each other
            ax.plot(xs, [0.03 + 0.035 * k] * len(xs), "x", color=color, markersize=8, clip_on=False,
                    transform=ax.get_xaxis_transform())
            mins = [r["min_feasible_ram_bytes"] for r in infeasible if r.get("min_feasible_ram_bytes")]
            if mins:  # a solved point's own peak can undercut a time-limited minimum-peak search
                mins += [r["peak_ram_bytes"] for r in solved if r.get("peak_ram_bytes")]
            # proven infeasible: up to the largest infeasible budget, or the smallest feasible one
            edge = min(mins) if mins else max(xs)
            drawn.add("band")
            ax.axvspan(min(xs) * 0.97, edge, color=color, alpha=0.10, lw=0)
            if mins:
                drawn.add("min_feasible")
                m = min(mins)
                ax.axvline(m, color=color, ls=":", lw=1.2)
                # horizontal, one line per series from the top down: two series' minima close
                # together would otherwise print on top of each other
                ax.annotate(f"{device} ({mode}): smallest feasible {size_text(m)}", xy=(m, 0.90 - 0.06 * k),
                            xycoords=ax.get_xaxis_transform(), xytext=(4, 0), textcoords="offset points",
                            color=color, fontsize=8, va="top",
                            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
        plain = next((r for r in members if r.get("plain_energy_j") is not None), None)
        if plain is not None:
            drawn.add("plain")
            ax.plot([plain["plain_peak_bytes"]], [plain["plain_energy_j"] / scale], "*", color=color, markersize=13,
                    markeredgecolor="black", markeredgewidth=0.5)
    # the key to the marks, in grey because it holds for every series' colour
    key = {
        "proven": Line2D([], [], marker="o", ls="", color="grey", label="solved: proven optimal or within the gap"),
        "time_limit": Line2D([], [], marker="o", ls="", color="grey", markerfacecolor="white",
                             label="solved: best found at the time limit"),
        "plain": Line2D([], [], marker="*", ls="", color="grey", markeredgecolor="black", markersize=11,
                        label="plain training (at its peak RAM)"),
        "infeasible": Line2D([], [], marker="x", ls="", color="grey", label="infeasible budget"),
        "band": Patch(facecolor="grey", alpha=0.25, lw=0, label="known infeasible region"),
        "min_feasible": Line2D([], [], ls=":", color="grey", label="smallest feasible budget"),
    }
    handles, _ = ax.get_legend_handles_labels()
    handles += [artist for name, artist in key.items() if name in drawn]
    model = rows[0]["model"] if rows else ""
    devices = list(dict.fromkeys(r["device"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    runtime = next((r["runtime_budget_s"] for r in rows if r.get("runtime_budget_s") is not None), None)
    ax.set_title(f"{model} on {', '.join(devices)}, mode {', '.join(modes)}\n"
                 "energy per training step vs RAM budget" + ("" if runtime is None else " (runtime budget applied)"),
                 fontsize=11)
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
    if handles:
        # beside the axes: inside, it would cover points wherever it went
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return fig
