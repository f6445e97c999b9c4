"""The README opens with exactly two commands, and they do what it says."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

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


def test_readme_first_command_solves_and_writes_a_valid_schedule(tmp_path):
    """Runs the solve part of the first command as written (the install part is what CI's own
    install already did), with the output redirected into a temporary directory."""
    first = readme_commands()[0]
    solve_part = first[first.index(".venv/bin/poet-opt"):]
    argv = shlex.split(solve_part)[1:]
    out_at = argv.index("--out") + 1
    expected_name = Path(argv[out_at]).name
    argv[out_at] = str(tmp_path / expected_name)
    run = subprocess.run([sys.executable, "-m", "poet_opt.cli", *argv, "-q"], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    doc = json.loads((tmp_path / expected_name).read_text())
    assert doc["format"] == "poet-opt/schedule@1"
    assert doc["model"] == "resnet18-cifar" and doc["device"]["name"] == "rpi4"
    assert doc["totals"]["peak_ram_bytes"] <= doc["budgets"]["ram_bytes"] == 1_500_000
    check = subprocess.run([sys.executable, "-m", "poet_opt.cli", "validate", str(tmp_path / expected_name)],
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 0, check.stderr
