"""One schedule as a picture: RAM in use over its steps, and what each stage computes, keeps and pages."""

from __future__ import annotations

from pathlib import Path

from poet_opt.plots.style import bytes_axis, pyplot, save_figure, size_text
from poet_opt.units import format_joules

# stage x node matrix codes and their colours
_CELLS = [("not resident", "#ffffff"), ("on storage", "#d9d2e9"), ("kept", "#9ecae1"), ("paged in", "#31a354"),
          ("recomputed", "#e6550d"), ("computed", "#08306b")]


def timeline(doc: dict) -> dict:
    """Replay a schedule document's steps: RAM after every step (total and per node), the steps
    that recompute or page, and the stage x node matrix (codes index ``_CELLS``). Stage t is the
    part of the plan that ends with node t's first computation (docs/schedule-format.md)."""
    nodes = doc["graph"]["nodes"]
    size = [int(n["bytes"]) for n in nodes]
    T = len(nodes)
    resident: set[int] = set()
    stored: set[int] = set()
    computed: set[int] = set()
    matrix = [[0] * T for _ in range(T)]
    total, per_node, marks = [], [], {"recompute": [], "page_in": [], "page_out": []}
    stage, opening = 0, True
    for k, step in enumerate(doc["steps"]):
        op, n = step["op"], int(step["node"])
        if op in ("compute", "page_in") and opening and stage < T:
            for i in resident:
                matrix[stage][i] = 2
            for i in stored - resident:
                matrix[stage][i] = max(matrix[stage][i], 1)
            opening = False
        row = matrix[min(stage, T - 1)]
        if op == "compute":
            resident.add(n)
            if n in computed:
                marks["recompute"].append(k)
                row[n] = max(row[n], 4)
            else:
                computed.add(n)
                matrix[min(n, T - 1)][n] = 5
                stage, opening = n + 1, True
        elif op == "page_in":
            resident.add(n)
            marks["page_in"].append(k)
            row[n] = max(row[n], 3)
        elif op == "page_out":
            stored.add(n)
            marks["page_out"].append(k)
        elif op == "free":
            resident.discard(n)
        total.append(sum(size[i] for i in resident))
        per_node.append(frozenset(resident))
    return {"total": total, "resident": per_node, "marks": marks, "matrix": matrix, "sizes": size}


def plot_timeline(doc: dict, path) -> list[Path]:
    """Two panels for one (validated) schedule document: RAM in use after every step, stacked by
    tensor (forward activations blue, gradients orange), with the budget and plain training's peak
    as lines and recomputations / page-ins / page-outs marked; and the stage x node matrix in the
    style of the Checkmate and POET papers. PNG at ``path``; with a .svg path, SVG and a PNG beside
    it; without a suffix both."""
    fig = timeline_figure(doc)
    try:
        return save_figure(fig, path)
    finally:
        pyplot().close(fig)


def timeline_figure(doc: dict):
    """The figure ``plot_timeline`` saves (tests read its legends)."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plt = pyplot()
    tl = timeline(doc)
    nodes = doc["graph"]["nodes"]
    T, S = len(nodes), len(doc["steps"])
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1.6, 1]})
    steps = np.arange(S)
    stack = np.zeros((T, S))
    for k, res in enumerate(tl["resident"]):
        for i in res:
            stack[i, k] = tl["sizes"][i]
    used = [i for i in range(T) if stack[i].any()]
    blues, oranges = plt.get_cmap("Blues"), plt.get_cmap("Oranges")
    colors = [(blues if nodes[i]["kind"] != "backward" else oranges)(0.35 + 0.5 * (i % 7) / 6) for i in used]
    if used:
        ax.stackplot(steps, stack[used], colors=colors, step="post", linewidth=0)
    ax.step(steps, tl["total"], where="post", color="black", lw=0.8, label="RAM in use")
    budget = (doc.get("budgets") or {}).get("ram_bytes")
    if budget is not None:
        ax.axhline(budget, color="red", ls="--", lw=1, label=f"RAM budget {size_text(budget)}")
    plain_peak = (doc.get("plain") or {}).get("peak_ram_bytes")
    if plain_peak:
        ax.axhline(plain_peak, color="grey", ls=":", lw=1, label=f"plain training peak {size_text(plain_peak)}")
    top = max([*tl["total"], budget or 0, plain_peak or 0, 1])
    for key, marker, color, label in (("recompute", "v", "#e6550d", "recompute"), ("page_in", "^", "#31a354", "page-in"),
                                      ("page_out", "s", "#756bb1", "page-out")):
        xs = tl["marks"][key]
        if xs:
            ax.plot(xs, [top * 1.04] * len(xs), marker, color=color, markersize=4, ls="", label=f"{label} ({len(xs)})")
    ax.set_ylim(0, top * 1.1)
    ax.set_xlim(0, max(S - 1, 1))
    ax.set_xlabel("step")
    ax.set_ylabel("RAM in use (activations and gradients)")
    bytes_axis(ax, "y")
    handles, _ = ax.get_legend_handles_labels()
    # the stacked bands: one shade per tensor, blues for forward activations, oranges for gradients
    if any(nodes[i]["kind"] != "backward" for i in used):
        handles.append(Patch(color=blues(0.6), label="forward activations (a band each)"))
    if any(nodes[i]["kind"] == "backward" for i in used):
        handles.append(Patch(color=oranges(0.6), label="gradients (a band each)"))
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    totals = doc.get("totals") or {}
    energy = totals.get("energy_j")
    ax.set_title(f"{doc.get('model', '')} on {(doc.get('device') or {}).get('name', '')}, mode {doc.get('mode', '')}"
                 + ("" if energy is None else f": {format_joules(energy)}"))

    cmap = ListedColormap([c for _, c in _CELLS])
    mx.imshow(np.array(tl["matrix"]), cmap=cmap, vmin=-0.5, vmax=len(_CELLS) - 0.5, interpolation="nearest",
              aspect="auto", origin="upper")
    mx.set_xlabel("node (topological order)")
    mx.set_ylabel("stage")
    mx.set_title("what each stage computes, keeps and pages")
    mx.legend(handles=[Patch(facecolor=c, edgecolor="grey", label=name) for name, c in _CELLS], fontsize=7,
              loc="upper right")
    fig.tight_layout()
    return fig
