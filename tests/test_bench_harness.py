"""The benchmark harness's assertions (benchmarks/bench.py is run by hand; its checks are tested here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(ours, dense_status="optimal", dense=1.0, dtr=(1.2, True), sqrt_n=(0.9, False)):
    case = {"case": "m@d@0.5@joint"}
    rows = [{**case, "method": "ours", "status": "optimal" if ours is not None else "no_solution",
             "energy_j": ours},
            {**case, "method": "poet-dense", "status": dense_status, "energy_j": dense, "fits": True},
            {**case, "method": "dtr", "energy_j": dtr[0], "fits": dtr[1]},
            {**case, "method": "sqrt-n", "energy_j": sqrt_n[0], "fits": sqrt_n[1]}]
    return rows


def test_no_fail_when_ours_is_best(bench):
    assert bench.check(_rows(1.0)) == []
    # a baseline below ours that does not fit the budget is no violation
    assert bench.check(_rows(1.0, sqrt_n=(0.5, False))) == []


def test_fail_when_a_fitting_baseline_beats_ours(bench):
    fails = bench.check(_rows(1.0, dense=1.0, dtr=(0.99, True)))
    assert len(fails) == 1 and "dtr" in fails[0] and fails[0].startswith("FAIL")


def test_fail_when_ours_finds_nothing_but_a_baseline_fits(bench):
    fails = bench.check(_rows(None, dense_status="time_limit"))
    assert len(fails) == 1 and "found no schedule" in fails[0]


def test_fail_only_against_a_proven_dense_optimum(bench):
    assert len(bench.check(_rows(1.01, dense=1.0, dtr=(1.2, True)))) == 1
    assert bench.check(_rows(1.01, dense_status="time_limit", dense=1.0, dtr=(1.2, True))) == []


def test_suite_covers_the_issue(bench):
    cases = bench.suite()
    for model in ("resnet18-cifar", "vgg16-cifar", "mobilenetv2", "resnet50", "bert-base", "transformer-block",
                  "rand100", "rand1000"):
        for fraction in ("0.9", "0.7", "0.5", "0.35"):
            assert f"{model}@rpi4@{fraction}@joint" in cases
            assert f"{model}@jetson-nano@{fraction}@joint" in cases
    assert any(c.endswith("@remat") for c in cases) and any("@nrf52840@" in c for c in cases)
    assert len(bench.make_graph("rand1000")) == 1000 and len(bench.make_graph("rand100")) == 100


def test_a_dense_model_given_our_starts_counts_as_dense_too(bench):
    rows = _rows(1.01, dense_status="time_limit", dense=1.0, dtr=(1.2, True))
    rows.append({"case": "m@d@0.5@joint", "method": "poet-dense+starts", "status": "optimal", "energy_j": 1.0,
                 "fits": True})
    fails = bench.check(rows)
    assert len(fails) == 1 and "poet-dense+starts" in fails[0]


def test_the_summary_gives_ratios_against_each_dense_variant(bench):
    case = {"case": "m@d@0.5@joint"}
    rows = [{**case, "method": "ours", "status": "optimal", "energy_j": 1.0, "solve_s": 0.5, "build_s": 0.0},
            {**case, "method": "poet-dense", "status": "optimal", "energy_j": 1.0, "fits": True,
             "solve_s": 20.0, "build_s": 0.0},
            {**case, "method": "poet-dense+starts", "status": "optimal", "energy_j": 1.0, "fits": True,
             "solve_s": 5.0, "build_s": 0.0}]
    text = "\n".join(bench.summary(rows))
    assert "median 40.0x" in text and "median 10.0x" in text
