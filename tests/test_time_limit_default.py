"""One default time limit for every command that solves: `solve`, `run`, `emulate`, `measure
--device` and each point of `pareto` give the solver 60 s unless told otherwise, so one model and budget get the same plan
from each; `none` waits for the proof; anything else is one line naming --time-limit."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from poet_opt.cli import main
from poet_opt.solver.time_budget import DEFAULT_TIME_LIMIT_S, parse_time_limit


class Seen(Exception):
    pass


def _spy(monkeypatch, module, name):
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        raise Seen

    monkeypatch.setattr(module, name, spy)
    return seen


COMMANDS = {
    "solve": ("poet_opt.solver.driver", "solve", ["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB"]),
    "run": ("poet_opt.executor.train", "run_training",
            ["run", "--torch", "x.py:f", "--input-shape", "2,4", "--device", "rpi4", "--ram", "1MB", "--steps", "1",
             "--lr", "0.1", "--data", "b.npz"]),
    "emulate": ("poet_opt.firmware.trainer", "emulate_training",
                ["emulate", "--model", "mlp", "--device", "stm32f746", "--ram", "64KiB", "--steps", "1", "--lr", "0.1",
                 "--data", "b.npz"]),
    "measure": ("poet_opt.firmware.step_costs", "measure_firmware",
                ["measure", "--model", "mlp", "--input-shape", "1,784", "--device", "stm32f746", "--ram", "64KiB",
                 "--out", "costs.csv"]),
    "pareto": ("poet_opt.pareto", "sweep", ["pareto", "--model", "mlp", "--device", "rpi4", "--ram", "1MB,2MB", "-o", "front"]),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("given, expected", [(None, DEFAULT_TIME_LIMIT_S), ("none", None), ("7.5", 7.5)])
def test_every_solving_command_has_the_same_default(command, given, expected, monkeypatch, tmp_path):
    import importlib

    module_name, function, argv = COMMANDS[command]
    seen = _spy(monkeypatch, importlib.import_module(module_name), function)
    monkeypatch.chdir(tmp_path)
    args = argv + ([] if given is None else ["--time-limit", given])
    result = CliRunner().invoke(main, args)
    assert "Seen" in result.output, result.output  # the CLI reports the spy's exception as an internal error
    assert "time_limit" in seen and seen["time_limit"] == expected, seen.get("time_limit")


@pytest.mark.parametrize("text", ["0", "-3", "inf", "nan", "soon", ""])
def test_a_bad_time_limit_is_one_line_naming_the_option(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB",
                                       "--time-limit", text])
    assert result.exit_code == 2, result.output
    assert "--time-limit" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    with pytest.raises(Exception, match="time"):
        parse_time_limit(text)
