"""Ctrl-C during a solve: the command stops, prints the best schedule found so far (or says none
was found), and exits 130. A Ctrl-C that lands in an early phase is not forgotten by the next."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import default_sigint

POET = [sys.executable, "-m", "poet_opt.cli"]


def _interrupt_after(delay_s: float, *args: str, tmp_path: Path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*POET, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path, preexec_fn=default_sigint)
    time.sleep(delay_s)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, time.perf_counter() - sent, out, err


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("delay_s", [1.0])
def test_ctrl_c_in_the_first_seconds_stops_within_two_seconds(tmp_path, delay_s):
    out_file = tmp_path / "plan.json"
    code, took, out, err = _interrupt_after(
        delay_s, "solve", "--model", "resnet50", "--device", "rpi4", "--ram", "20MB", "--gap", "0", "--out",
        str(out_file), tmp_path=tmp_path)
    assert code == 130, (out, err)
    assert took < 2.0 + 1.0, took  # 2 s promised; a loaded CI core gets a little slack
    if "interrupted before any schedule" in err or "interrupted; nothing was written" in err:
        # stopped before the search had a plan (on a loaded machine, still building the model)
        assert not out_file.exists()
    else:
        assert "interrupted" in out and "claim" in out
        assert out_file.exists()  # the best valid plan so far, written because --out was given


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_deep_in_a_long_solve_keeps_the_best_schedule_and_stops_within_two_seconds(tmp_path):
    """At 20 s ResNet-50's full MILP (180k columns, --gap 0: minutes to the end) is in HiGHS's
    presolve or search, which called nothing back for 10 s after a Ctrl-C before HiGHS ran in a
    thread of its own. Progress says which phase runs at least every few seconds throughout."""
    out_file = tmp_path / "plan.json"
    code, took, out, err = _interrupt_after(
        20.0, "solve", "--model", "resnet50", "--device", "rpi4", "--ram", "20MB", "--gap", "0", "--out",
        str(out_file), tmp_path=tmp_path)
    assert code == 130, (out, err)
    assert took < 2.0 + 1.0, took
    assert "interrupted" in out and "claim" in out and out_file.exists()
    assert json.loads(out_file.read_text())["solver"]["status"] == "interrupted"
    stamps = [float(m) for m in re.findall(r"^  \[\s*([0-9.]+)s\] ", err, flags=re.M)]
    assert len(stamps) >= 4, err
    assert max(b - a for a, b in zip(stamps, stamps[1:])) <= 5.0, err


def test_a_ctrl_c_where_no_milp_runs_says_interrupted(monkeypatch):
    """On graphs whose full MILP is skipped (bert-base), a Ctrl-C lands in the bounds or the window
    search, not in a MILP: the solve keeps its best plan and says "interrupted" (exit 130 from the
    CLI), not "time_limit"."""
    import poet_opt.solver.driver as driver
    from poet_opt.solver.backends import interrupt_scope
    from test_residency import DEVICE
    from test_stream_bound import chain

    graph = chain()
    seen = {}

    def ctrl_c_in_the_bound(*args, **kwargs):
        with interrupt_scope() as flag:  # inside the solve's scope: its own flag, as a Ctrl-C sets it
            seen["active"] = not flag.is_set()
            flag.set()
        return None

    monkeypatch.setattr(driver, "FULL_MILP_MAX_DECISIONS", 0)
    monkeypatch.setattr(driver, "window_bound", ctrl_c_in_the_bound)
    schedule = driver.solve(graph, DEVICE, ram=graph.min_working_set_bytes() + 1024, order="given", time_limit=20)
    assert seen.get("active"), "the window bound ran, inside the solve"
    assert schedule.solver["status"] == "interrupted", schedule.solver["status"]
