"""The README opens with exactly two commands, and they do what it says."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert block, "README must open with a sh code block"
    assert text.index(block.group(0)) < text.index("## "), "the commands come before any section"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_commands_and_ci_runs_the_second():
    commands = readme_commands()
    assert len(commands) == 2
    assert "poet-opt solve" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines(), ".ci/run must run the README's test command unchanged"


def test_readme_first_command_writes_a_valid_schedule_header_and_plot(tmp_path):
    """Runs the poet-opt parts of the first command as written (the install part is what CI's own
    install already did), with every output path moved into a temporary directory."""
    first = readme_commands()[0]
    invocations = [shlex.split(part)[1:] for part in first.split("&&") if ".venv/bin/poet-opt" in part]
    assert [argv[0] for argv in invocations] == ["solve", "plot"]
    moved = {}
    for argv in invocations:
        for k, arg in enumerate(argv):
            if arg.startswith("schedules/"):
                moved[arg] = argv[k] = str(tmp_path / Path(arg).name)
    for argv in invocations:
        run = subprocess.run([sys.executable, "-m", "poet_opt.cli", *argv, *(["-q"] if argv[0] == "solve" else [])],
                             capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert run.returncode == 0, run.stderr
    schedule, header, picture = (Path(moved[f"schedules/resnet18-cifar-rpi4.{ext}"]) for ext in ("json", "h", "png"))
    doc = json.loads(schedule.read_text())
    assert doc["format"] == "poet-opt/schedule@1"
    assert doc["model"] == "resnet18-cifar" and doc["device"]["name"] == "rpi4"
    assert doc["totals"]["peak_ram_bytes"] <= doc["budgets"]["ram_bytes"] == 1_500_000
    check = subprocess.run([sys.executable, "-m", "poet_opt.cli", "validate", str(schedule)],
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 0, check.stderr
    assert "#define POET_ARENA_BYTES" in header.read_text()
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_readme_says_once_how_the_docs_commands_run_after_the_first(tmp_path):
    """The first command leaves poet-opt in .venv/bin, while the README's later commands and the docs
    write `poet-opt ...` and `python ...`. Before its first section the README says how to make them
    work, and what it says works: in a shell whose PATH lacks the environment, it brings poet-opt and
    the environment's python (with poet_opt importable) onto it."""
    text = (ROOT / "README.md").read_text()
    said = re.search(r"`(\. \.venv/bin/activate)`", text[: text.index("## ")])
    assert said, "the README must say, before its first section, how to activate .venv"
    venv_bin = Path(sys.prefix) / "bin"
    if not (venv_bin / "activate").is_file():
        pytest.skip("the suite runs outside a virtual environment: there is no bin/activate to try")
    (tmp_path / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != venv_bin.resolve())
    before = subprocess.run(["bash", "-c", "command -v poet-opt"], cwd=tmp_path, env=env, capture_output=True, text=True)
    if before.returncode == 0:
        pytest.skip(f"poet-opt is on PATH without the environment ({before.stdout.strip()}): nothing to prove here")
    after = subprocess.run(["bash", "-c", f"{said.group(1)} && poet-opt --version && python -c 'import poet_opt'"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert after.returncode == 0, after.stderr
    assert after.stdout.startswith("poet-opt, version")
