"""The solve's heartbeat: alive during phases that report nothing, showing the best plan so far."""

import time

import poet_opt.solver.backends as backends
from poet_opt.solver.backends import Heartbeat


def _beats_during(heartbeat: Heartbeat, seen: list, name: str, incumbent=None) -> list:
    heartbeat.phase(name, incumbent)
    count = len(seen)
    deadline = time.monotonic() + 5.0
    while len(seen) == count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(seen) > count, f"no heartbeat during {name!r}"
    return seen[-1]


def test_the_heartbeat_shows_the_least_energy_of_the_plans_it_was_given(monkeypatch):
    monkeypatch.setattr(backends, "HEARTBEAT_S", 0.05)
    seen = []
    with Heartbeat(seen.append) as heartbeat:
        first = _beats_during(heartbeat, seen, "heuristic starts")
        assert first.phase == "heuristic starts" and first.incumbent is None
        assert _beats_during(heartbeat, seen, "window search", 22.9).incumbent == 22.9
        # a phase given a dearer plan (another order's) does not hide the better one found before
        later = _beats_during(heartbeat, seen, "residency bound", 23.4)
        assert (later.phase, later.incumbent) == ("residency bound", 22.9)
        assert _beats_during(heartbeat, seen, "window bound").incumbent == 22.9
        assert _beats_during(heartbeat, seen, "window search", 22.1).incumbent == 22.1
    # a bound holds for one execution order only: the heartbeat never claims one
    assert all(p.bound is None and p.gap is None for p in seen)


def test_a_heartbeat_line_names_the_incumbent_in_joules(capsys, monkeypatch):
    monkeypatch.setattr(backends, "HEARTBEAT_S", 0.05)
    with Heartbeat(backends.print_progress) as heartbeat:
        heartbeat.phase("window search", 22.7787)
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all("window search: incumbent 22.7787 J  bound -  gap -" in line for line in lines)
