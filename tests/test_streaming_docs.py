"""The claims of docs/streaming.md and benchmarks/STREAMING.md, on graphs small enough to solve in seconds:
frozen layers write nothing, fewer trained layers write less and wear the card less, and the naive
streaming plan (each layer's weights read right before every use) is valid and never beats ours."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from poet_opt.schedule import validator
from poet_opt.solver.driver import solve

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def streaming():
    spec = importlib.util.spec_from_file_location("streaming_bench", ROOT / "benchmarks" / "streaming.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_frozen_layers_write_nothing_and_fewer_trained_layers_wear_less(streaming):
    # mcu-vww at a small input: the same 27 weighted layers, solved in about a second each
    rows = streaming.trainable_rows("mcu-vww", "nrf52840", "100KiB", ("all", "last:2", "last:1"),
                                    input_shape="1x48x48", time_limit=10, gap=0.01)
    for row in rows:
        assert row["frozen_written_bytes"] == 0, row
        # SGD writes back exactly the trained weights, once per step
        assert row["written_bytes"] == row["trained_param_bytes"], row
    assert rows[0]["frozen_param_bytes"] == 0 < rows[1]["frozen_param_bytes"] < rows[2]["frozen_param_bytes"]
    written = [r["written_bytes"] for r in rows]
    lifetime = [r["lifetime_steps"] for r in rows]
    assert written[0] > written[1] > written[2] > 0
    # the nRF52840's SD card levels wear over its capacity, and takes a step's writes as one log of
    # whole 4 MiB units: less written wears no more (here every step fits one unit)
    assert lifetime[0] <= lifetime[1] <= lifetime[2]
    assert rows[2]["energy_j"] < rows[0]["energy_j"]


def test_the_published_trainable_table_says_the_same(streaming):
    text = (ROOT / "docs" / "streaming.md").read_text()
    section = text.split(streaming.BEGIN, 1)[1].split(streaming.END, 1)[0]
    by_case: dict[str, list[list[str]]] = {}
    for line in section.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        by_case.setdefault(cells[0], []).append(cells)
    assert len(by_case) == len(streaming.TRAINABLE_CASES)

    def size(text: str) -> float:
        number, unit = text.split()
        return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]

    for case, rows in by_case.items():
        assert [r[6] for r in rows] == ["0 B"] * len(rows), case  # written to frozen weights
        written = [size(r[4]) for r in rows]
        assert written == sorted(written, reverse=True) and written[-1] < written[0], case
        lifetime = [int(re.sub(r"\D", "", r[8])) for r in rows]
        assert lifetime == sorted(lifetime), case  # longer or, on raw NOR flash, the same


@pytest.mark.parametrize("model, shape, device, ram", [
    ("mlp", 64, "nrf52840", "400KiB"),
    # sliced layers reading one input, and a skip connection: partial-sum gradient nodes
    ("mlp-residual", 64, "nrf52840", "200KiB"),
    ("mcu-vww", "1x48x48", "stm32f746", "200KiB"),
])
def test_the_naive_plan_is_valid_and_never_cheaper_than_ours(streaming, model, shape, device, ram):
    graph = streaming.streamed_graph(model, ram, input_shape=shape)
    naive = streaming.naive_schedule(graph, device)  # validates, raising on any broken rule
    doc = naive.to_dict()
    assert validator.validate(doc)["storage_written_bytes"] == graph.streamed_param_bytes
    # every param node is read once per reader, and nothing else is recomputed
    users = graph.users()
    reads = sum(n.bytes * len(users[n.id]) for n in graph.nodes if n.op == "param")
    inputs = sum(n.bytes for n in graph.nodes if n.op == "input")
    assert naive.totals["storage_read_bytes"] == reads + inputs
    assert {graph.nodes[i].op for _, i in naive.decisions.recompute} == {"param"}
    # the same budget as the naive plan's own peak: the naive plan is one of the plans ours chose from
    gap = 1e-3
    ours = solve(graph, device, ram=naive.totals["peak_ram_bytes"], time_limit=15, gap=gap)
    assert ours.totals["energy_j"] <= naive.totals["energy_j"] / (1 - gap)


def test_traffic_accounts_for_every_byte_the_plan_moves(streaming):
    """`benchmarks/streaming.py traffic` splits a strip plan's storage traffic by stage and kind:
    what it reads (weights, again or not, the input, pages in) adds up to the plan's bytes read,
    and the pages out plus the updated weights written back to its bytes written."""
    from poet_opt.device.profiles import load_profile
    from poet_opt.model.zoo import build_model

    graph = build_model("mcu-vww", weights="streamed", strips=4, input_shape="1x48x48")
    totals, moved = streaming.traffic(graph, load_profile("nrf52840"), "40KiB")
    kinds = {k for m in moved.values() for k in m}
    assert {"weights, first read", "weights read again (backward)", "input read"} <= kinds
    read = sum(v for m in moved.values() for k, v in m.items() if not k.startswith("paged out"))
    written = sum(v for m in moved.values() for k, v in m.items() if k.startswith("paged out"))
    assert read == totals["storage_read_bytes"]
    assert written + sum(n.writes_bytes for n in graph.nodes) == totals["storage_written_bytes"]
    assert {"paged in (forward)", "paged out (forward)"} <= kinds
    table = streaming.traffic_table(moved)
    assert table.count("\n") == len(moved) + 2 and "| all |" in table
