"""The plots explain themselves: every kind of mark, band and line drawn has a legend entry (and no
entry stands for something not drawn), byte axes are in binary units, and the title names the
model, the device(s) and the mode(s). Hand-made rows and a small solved schedule: a few seconds."""

from __future__ import annotations

import re

import pytest
from conftest import make_test_device

from poet_opt import plots
from poet_opt.model.random_graph import random_training_graph
from poet_opt.plots.style import binary_ticks
from poet_opt.solver.driver import solve

KIB, MIB = 1024, 1024 * 1024

# the key to the marks of the front plot, as the legend spells it
KEY = {
    "proven": "solved: proven optimal or within the gap",
    "time_limit": "solved: best found at the time limit",
    "plain": "plain training (at its peak RAM)",
    "infeasible": "infeasible budget",
    "band": "known infeasible region",
    "min_feasible": "smallest feasible budget",
}


def _row(device, mode, ram, status, energy=None, **extra):
    row = {"model": "resnet18-cifar", "device": device, "mode": mode, "ram_bytes": ram, "status": status,
           "energy_j": energy, "plain_energy_j": 5.0, "plain_peak_bytes": 4 * MIB, "peak_ram_bytes": ram,
           "min_feasible_ram_bytes": None, "runtime_budget_s": None}
    row.update(extra)
    return row


def _legend(fig):
    """(texts of the figure's first axes' legend, labels matplotlib finds on that axes itself)."""
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert legend is not None, "the plot has no legend"
    _, own = ax.get_legend_handles_labels()
    return [t.get_text() for t in legend.get_texts()], own


def _tick_labels(fig, axis="x"):
    fig.canvas.draw()  # tick labels exist only once drawn
    ax = fig.axes[0]
    ticks = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [t.get_text() for t in ticks if t.get_text()]


def test_front_legend_has_an_entry_for_every_kind_of_mark():
    rows = [
        _row("rpi4", "joint", 1 * MIB, "infeasible", min_feasible_ram_bytes=1.3 * MIB),
        _row("rpi4", "joint", 2 * MIB, "optimal", 5.2),
        _row("rpi4", "joint", 3 * MIB, "time_limit", 5.1),
        _row("nrf52840", "joint", 2 * MIB, "gap_limit", 0.9, plain_energy_j=0.8),
    ]
    fig = plots.front_figure(rows)
    try:
        texts, own = _legend(fig)
        # one line per series, found by matplotlib on the axes (so they carry the series' colour)
        assert own == ["rpi4 (joint)", "nrf52840 (joint)"]
        assert texts == own + list(KEY.values())
        title = fig.axes[0].get_title()
        assert "resnet18-cifar" in title and "rpi4, nrf52840" in title and "joint" in title
        labels = _tick_labels(fig)
        assert labels and all(re.fullmatch(r"[\d.]+ (KiB|MiB)|0", t) for t in labels), labels
        # the smallest feasible budget is annotated in the same units
        notes = [t.get_text() for t in fig.axes[0].texts]
        assert notes == ["rpi4 (joint): smallest feasible 1.3 MiB"]
    finally:
        fig.clf()


def test_front_legend_has_no_entry_for_a_mark_not_drawn():
    rows = [_row("rpi4", "remat", 2 * MIB, "optimal", 5.2), _row("rpi4", "remat", 3 * MIB, "optimal", 5.0)]
    fig = plots.front_figure(rows)
    try:
        texts, _ = _legend(fig)
        assert texts == ["rpi4 (remat)", KEY["proven"], KEY["plain"]]
        assert "rpi4" in fig.axes[0].get_title() and "remat" in fig.axes[0].get_title()
    finally:
        fig.clf()


@pytest.mark.parametrize("lo, hi, unit", [(100 * KIB, 900 * KIB, KIB), (1 * MIB, 5 * MIB, MIB),
                                          (1_000_000, 5_000_000, MIB)])
def test_byte_ticks_fall_on_round_binary_values(lo, hi, unit):
    ticks = [t for t in binary_ticks(lo, hi) if lo <= t <= hi]
    assert len(ticks) >= 3
    # round in the binary unit: 1.5 MiB, 2 MiB, never 0.954 MiB (1 MB)
    assert all((t / unit * 4) == int(t / unit * 4) for t in ticks), ticks


def test_timeline_legend_names_the_bands_lines_and_marks():
    graph = random_training_graph(8, seed=1)
    doc = solve(graph, make_test_device(), ram=22000, mode="paging", time_limit=20, gap=0.0).to_dict()
    assert doc["totals"]["page_ins"] > 0  # else the page marks below would rightly be absent
    fig = plots.timeline_figure(doc)
    try:
        texts, own = _legend(fig)
        budget = "RAM budget 21.5 KiB"  # 22000 B, in binary units
        assert own[:2] == ["RAM in use", budget]
        assert f"page-in ({doc['totals']['page_ins']})" in texts
        assert f"page-out ({doc['totals']['page_outs']})" in texts
        assert "forward activations (a band each)" in texts and "gradients (a band each)" in texts
        assert ("recompute" in " ".join(texts)) == (doc["totals"]["recomputes"] > 0)
        title = fig.axes[0].get_title()
        assert doc["model"] in title and doc["device"]["name"] in title and "mode paging" in title
        labels = _tick_labels(fig, "y")
        assert labels and all(re.fullmatch(r"[\d.]+ (B|KiB|MiB)|0", t) for t in labels), labels
        # the stage x node matrix: every colour it can show, the white of "not resident" too
        matrix_texts = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
        assert matrix_texts == ["not resident", "on storage", "kept", "paged in", "recomputed", "computed"]
    finally:
        fig.clf()
