"""The checked-in examples in schedules/examples/: every schedule validates, every header is exactly
what `poet-opt export` makes of its schedule today (so a change to the generator that forgets to
regenerate them fails here: `python schedules/regenerate.py --headers-only`), every arena fits its
budget, and every header compiles warning-free as strict C99 and for a Cortex-M4."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from poet_opt.firmware.header import export
from poet_opt.schedule.validator import load_and_validate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "schedules" / "examples"
GCC = shutil.which("gcc")
ARM_GCC = shutil.which("arm-none-eabi-gcc")
STRICT = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-Wunused-const-variable=2"]


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("poet_examples_regenerate", ROOT / "schedules" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


NAMES = sorted(_regenerate_module().EXAMPLES)


def test_every_example_is_checked_in():
    assert len(NAMES) >= 4
    assert sorted(p.stem for p in EXAMPLES.glob("*.json")) == NAMES
    assert sorted(p.stem for p in EXAMPLES.glob("*.h")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_checked_in_header_matches_the_generator(name):
    doc, totals = load_and_validate(EXAMPLES / f"{name}.json")
    header, plan, _ = export(doc)
    assert header == (EXAMPLES / f"{name}.h").read_text(encoding="utf-8"), (
        f"{name}.h is stale: run `.venv/bin/python schedules/regenerate.py --headers-only`")
    # each example shows a real trade-off, and its arena fits the budget it states
    assert totals["recomputes"] + totals["page_outs"] > 0
    assert totals["peak_ram_bytes"] == plan.live_peak_bytes <= plan.arena_bytes <= doc["budgets"]["ram_bytes"]
    assert totals["peak_ram_bytes"] < doc["plain"]["peak_ram_bytes"]


def test_the_microcontroller_example_fits_its_board():
    doc, _ = load_and_validate(EXAMPLES / "mcu-vww-nrf52840.json")
    _, plan, _ = export(doc)
    mem = doc["memory"]
    assert mem["param_bytes"] + mem["param_grad_bytes"] + plan.arena_bytes <= doc["device"]["ram_bytes"]


MAIN = """#include "plan.h"
int main(void) { return (int)(POET_STEPS[0].kind + POET_NUM_STEPS % 2u + POET_ARENA_BYTES % 2u); }
"""


def compile_header(tmp_path: Path, name: str, cc: str, *flags: str) -> None:
    (tmp_path / "plan.h").write_bytes((EXAMPLES / f"{name}.h").read_bytes())
    (tmp_path / "main.c").write_text(MAIN)
    cmd = [cc, *STRICT, *flags, "-I", str(tmp_path), "-c", str(tmp_path / "main.c"), "-o", str(tmp_path / "main.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


@pytest.mark.skipif(GCC is None, reason="gcc not installed")
@pytest.mark.parametrize("names", [[], ["-DPOET_WITH_NAMES"]])
@pytest.mark.parametrize("name", NAMES)
def test_example_header_compiles_as_strict_c99(tmp_path, name, names):
    compile_header(tmp_path, name, GCC, *names)


@pytest.mark.skipif(ARM_GCC is None, reason="arm-none-eabi-gcc not installed")
@pytest.mark.parametrize("name", NAMES)
def test_example_header_compiles_for_cortex_m4(tmp_path, name):
    compile_header(tmp_path, name, ARM_GCC, "-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16",
                   "-DPOET_WITH_NAMES")
