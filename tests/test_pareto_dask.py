"""`poet-opt pareto --scheduler`: the same sweep on a real Dask cluster (a LocalCluster on loopback
started here, its workers threads of this process) gives the same CSV as the local process pool;
an unreachable scheduler is one line and exit 2."""

from __future__ import annotations

import csv

import distributed  # the test extra pulls in dask: CI runs this file
import pytest
from click.testing import CliRunner

from conftest import make_test_device
from poet_opt import pareto
from poet_opt.pareto import executors
from poet_opt.cli import main
from poet_opt.model.zoo import build_model

MLP = build_model("mlp")
RAMS = [MLP.min_working_set_bytes() // 2, MLP.min_working_set_bytes(),
        (MLP.min_working_set_bytes() + MLP.plain_peak_bytes()) // 2, MLP.plain_peak_bytes()]
FAST = {"time_limit": 20, "gap": 0.0}
TIMINGS = {"solve_s"}  # the only columns that may differ between two runs of one sweep


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, protocol="tcp",
                                  host="127.0.0.1", dashboard_address=None) as c:
        yield c


def _csv_rows(path):
    with open(path, newline="") as fh:
        return [{k: v for k, v in row.items() if k not in TIMINGS} for row in csv.DictReader(fh)]


def test_a_dask_cluster_gives_the_local_rows(cluster, tmp_path):
    assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    local = pareto.sweep("mlp", [make_test_device()], RAMS, modes=("joint", "remat"), jobs=2, **FAST)
    remote = pareto.sweep("mlp", [make_test_device()], RAMS, modes=("joint", "remat"), jobs=2,
                          scheduler=cluster.scheduler_address, **FAST)
    assert not remote.interrupted
    pareto.write_csv(local, tmp_path / "local.csv")
    pareto.write_csv(remote, tmp_path / "remote.csv")
    rows = _csv_rows(tmp_path / "remote.csv")
    assert rows == _csv_rows(tmp_path / "local.csv")
    statuses = {r["status"] for r in rows}
    assert "infeasible" in statuses and {"optimal", "optimal_for_order"} & set(statuses)  # both kinds of row went through the cluster


def test_cli_on_a_dask_cluster_writes_the_local_csv(cluster, tmp_path):
    common = ["pareto", "--model", "mlp", "--device", "rpi4", "--device", "nrf52840",
              "--ram", ",".join(f"{r}B" for r in RAMS), "--gap", "0", "--time-limit", "20", "--jobs", "2", "-q"]
    here = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "here")])
    there = CliRunner().invoke(main, [*common, "--scheduler", cluster.scheduler_address, "-o", str(tmp_path / "there")])
    assert here.exit_code == 0, here.output
    assert there.exit_code == 0, there.output
    for name in ("pareto.csv", "pareto_front.csv"):
        assert _csv_rows(tmp_path / "there" / name) == _csv_rows(tmp_path / "here" / name), name
    assert (tmp_path / "there" / "pareto.png").stat().st_size > 1000


def test_an_unreachable_scheduler_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(executors, "DASK_CONNECT_TIMEOUT_S", 1.0)
    out = tmp_path / "never"
    for address, needle in (("tcp://127.0.0.1:1", "cannot reach the Dask scheduler at tcp://127.0.0.1:1"),
                            ("127.0.0.1:1", "tcp://HOST:PORT")):
        result = CliRunner().invoke(main, ["pareto", "--model", "mlp", "--device", "rpi4", "--ram", "8KB",
                                           "--scheduler", address, "-o", str(out)])
        assert result.exit_code == 2, (result.output, result.exception)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("poet-opt: error: --scheduler: "), lines
        assert needle in lines[0]
        assert "Traceback" not in result.output
    assert not out.exists()
