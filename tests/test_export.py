"""The C header export: it compiles warning-free as strict C99 (and for a Cortex-M4 where that
compiler exists), a small C program walking its step table finds every tensor where the plan put
it, and `poet-opt export` / `solve --export` follow the CLI's rules for bad input: one line, exit 2,
no file written."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from poet_opt.firmware.arena import plan_arena, plan_flash
from poet_opt.cli import main
from poet_opt.errors import PoetError
from poet_opt.firmware.header import _uint, render_header
from poet_opt.model.random_graph import random_training_graph
from poet_opt.solver.driver import solve
from poet_opt.model.zoo import build_model

GCC = shutil.which("gcc")
ARM_GCC = shutil.which("arm-none-eabi-gcc")
# -Wunused-const-variable=2 also flags unused static const tables in headers (clang does by default)
STRICT = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-Wunused-const-variable=2"]
needs_gcc = pytest.mark.skipif(GCC is None, reason="gcc not installed")

MLP = build_model("mlp")
MLP_RAM = (MLP.plain_peak_bytes() + MLP.min_working_set_bytes()) // 2


def solved_mlp(device: str) -> dict:
    return solve(MLP, device, ram=MLP_RAM, time_limit=20, model_name="mlp").to_dict()


@pytest.fixture(scope="module")
def mlp_doc() -> dict:
    """The mlp halfway between its minimum working set and plain peak on the nRF52840: paged."""
    doc = solved_mlp("nrf52840")
    assert doc["totals"]["page_outs"] > 0, doc["totals"]
    return doc


@pytest.fixture(scope="module")
def mlp_remat_doc() -> dict:
    """The same budget on the rpi4, where recomputing (the free input) wins over paging. Between
    them the two mlp schedules exercise both; no single mlp schedule reliably does, since
    recomputing the input costs nothing and so ties with not doing it."""
    doc = solved_mlp("rpi4")
    assert doc["totals"]["recomputes"] > 0, doc["totals"]
    return doc


@pytest.fixture(scope="module")
def skip_doc(test_device) -> dict:
    g = random_training_graph(8, seed=2)
    assert any(len(n.deps) > 1 for n in g.nodes if n.kind == "forward"), "want skip connections"
    lo, hi = g.min_working_set_bytes(), g.plain_peak_bytes()
    doc = solve(g, test_device, ram=int(lo + 0.1 * (hi - lo)), time_limit=20, model_name=g.name).to_dict()
    assert doc["totals"]["recomputes"] > 0 and doc["totals"]["page_outs"] > 0, doc["totals"]
    return doc


# Walks the table as firmware would, with an owner per arena byte: a tensor must land on free
# bytes, each operand must be the resident tensor of the node POET_OPERAND_NODES names, page_out/free
# must find the node where its step says.
WALKER = r"""
#include <stdio.h>
#include "plan.h"

static int32_t owner[POET_ARENA_BYTES + 1];

int main(void) {
    unsigned long written = 0;
    uint32_t s, b, k;
    for (b = 0; b < POET_ARENA_BYTES; b++) owner[b] = -1;
    for (s = 0; s < POET_NUM_STEPS; s++) {
        const POET_step_t *st = &POET_STEPS[s];
        if (st->node >= POET_NUM_TENSORS || st->bytes != POET_NODE_BYTES[st->node]) return 10;
        if (st->arena_offset % POET_ARENA_ALIGNMENT || st->arena_offset + st->bytes > POET_ARENA_BYTES) return 11;
        switch (st->kind) {
        case POET_COMPUTE:
            if (st->num_operands && (uint32_t)st->first_operand + st->num_operands > POET_NUM_OPERANDS) return 12;
            for (k = 0; k < st->num_operands; k++)
                if (owner[POET_OPERANDS[st->first_operand + k]] != (int32_t)POET_OPERAND_NODES[st->first_operand + k])
                    return 13;
            /* fall through */
        case POET_PAGE_IN:
            if (st->kind == POET_PAGE_IN && st->flash_offset + st->bytes > POET_FLASH_BYTES) return 14;
            for (b = st->arena_offset; b < st->arena_offset + st->bytes; b++) {
                if (owner[b] >= 0) return 15;
                owner[b] = (int32_t)st->node;
            }
            break;
        case POET_PAGE_OUT:
            if (st->flash_offset % POET_REGION_ALIGNMENT_BYTES || st->flash_offset + st->bytes > POET_FLASH_BYTES) return 16;
            written += st->bytes;
            /* fall through */
        case POET_FREE:
            for (b = st->arena_offset; b < st->arena_offset + st->bytes; b++) {
                if (owner[b] != (int32_t)st->node) return 17;
                if (st->kind == POET_FREE) owner[b] = -1;
            }
            break;
        default:
            return 18;
        }
    }
#ifdef POET_WITH_NAMES
    for (k = 0; k < POET_NUM_TENSORS; k++) printf("name %s\n", POET_NODE_NAMES[k]);
#endif
    printf("ok %u %u %lu\n", (unsigned)POET_NUM_STEPS, (unsigned)POET_NUM_OPERANDS, written);
    return 0;
}
"""


def compile_c(tmp_path: Path, header: str, source: str, *flags: str, cc: str | None = GCC, run: bool = False) -> str:
    (tmp_path / "plan.h").write_text(header)
    (tmp_path / "main.c").write_text(source)
    exe = tmp_path / "walker"
    cmd = [cc, *STRICT, *flags, "-I", str(tmp_path), str(tmp_path / "main.c")]
    cmd += ["-o", str(exe)] if run else ["-c", "-o", str(tmp_path / "main.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    if not run:
        return ""
    out = subprocess.run([str(exe)], capture_output=True, timeout=60)
    assert out.returncode == 0, f"walker exit {out.returncode}"
    return out.stdout.decode("utf-8")


def export(doc: dict, prefix="POET_"):
    plan, flash = plan_arena(doc), plan_flash(doc)
    return render_header(doc, plan, flash, prefix=prefix), plan, flash


@needs_gcc
@pytest.mark.parametrize("which", ["mlp_doc", "mlp_remat_doc", "skip_doc"])
@pytest.mark.parametrize("names", [False, True])
def test_header_compiles_strictly_and_the_step_table_replays(request, tmp_path, which, names):
    doc = request.getfixturevalue(which)
    header, plan, flash = export(doc)
    out = compile_c(tmp_path, header, WALKER, *(["-DPOET_WITH_NAMES"] if names else []), run=True)
    n_operands = sum(len(o) for o in plan.operand_offsets)
    assert out.splitlines()[-1] == f"ok {len(doc['steps'])} {n_operands} {flash.bytes_written_per_step}"
    got = [line[5:] for line in out.splitlines() if line.startswith("name ")]
    assert got == ([n["name"] for n in doc["graph"]["nodes"]] if names else [])


@pytest.mark.skipif(ARM_GCC is None, reason="arm-none-eabi-gcc not installed")
@pytest.mark.parametrize("names", [[], ["-DPOET_WITH_NAMES"]])
def test_header_compiles_for_cortex_m4(tmp_path, mlp_doc, names):
    source = '#include "plan.h"\nunsigned first_kind(void) { return POET_STEPS[0].kind; }\n'
    compile_c(tmp_path, export(mlp_doc)[0], source, "-mcpu=cortex-m4", "-mthumb", *names, cc=ARM_GCC)


def test_header_layout(skip_doc):
    header, plan, flash = export(skip_doc)
    assert re.findall(r"^#include.*$", header, re.M) == ["#include <stdint.h>"]
    assert header.startswith("/*") and "#ifndef POET_SCHEDULE_H\n#define POET_SCHEDULE_H\n" in header
    assert header.rstrip().endswith("#endif /* POET_SCHEDULE_H */")
    assert "malloc" not in header
    defines = dict(re.findall(r"^#define POET_(\w+) (\d+)u$", header, re.M))
    assert int(defines["ARENA_BYTES"]) == plan.arena_bytes
    assert int(defines["LIVE_PEAK_BYTES"]) == skip_doc["totals"]["peak_ram_bytes"]
    assert int(defines["FLASH_BYTES"]) == flash.flash_bytes > 0
    assert int(defines["NUM_STEPS"]) == len(skip_doc["steps"])
    assert int(defines["NUM_TENSORS"]) == len(skip_doc["graph"]["nodes"])
    assert int(defines["NUM_OPERANDS"]) == sum(len(o) for o in plan.operand_offsets)
    assert int(defines["MAX_OPERANDS"]) == max(len(o) for o in plan.operand_offsets) > 1
    table = re.search(r"POET_OPERAND_NODES\[\d+\] POET_UNUSED = \{([^}]*)\}", header).group(1)
    nodes = skip_doc["graph"]["nodes"]
    want = [d for step in skip_doc["steps"] if step["op"] == "compute" for d in nodes[step["node"]]["deps"]]
    assert [int(v.strip().rstrip("u")) for v in table.split(",") if v.strip()] == want
    for needle in ("test-board", skip_doc["model"], "energy", "generated by poet-opt"):
        assert needle in header.split("*/")[0]


@needs_gcc
def test_two_prefixes_coexist_and_the_guard_holds(tmp_path, mlp_doc, skip_doc):
    (tmp_path / "a.h").write_text(export(mlp_doc, prefix="MLP_")[0])
    source = ('#include "a.h"\n#include "a.h"\n#include "plan.h"\n'
              "unsigned total(void) { return MLP_NUM_STEPS + RND_NUM_STEPS + MLP_STEPS[0].kind + RND_OPERANDS[0]; }\n")
    compile_c(tmp_path, export(skip_doc, prefix="RND_")[0], source, "-DMLP_WITH_NAMES", "-DRND_WITH_NAMES")


def one_node_doc(name="only") -> dict:
    return {"format": "poet-opt/schedule@1", "model": "tiny", "mode": "none", "generator": "test",
            "device": {"name": "d", "alignment_bytes": 8, "erase_block_bytes": 4096, "endurance_cycles": 10},
            "graph": {"name": "tiny", "nodes": [{"id": 0, "name": name, "bytes": 12, "deps": []}]},
            "budgets": {"ram_bytes": 100, "runtime_s": None, "storage_bytes": 0},
            "steps": [{"op": "compute", "node": 0}, {"op": "free", "node": 0}],
            "totals": {"energy_j": 0.0, "compute_j": 0.0, "page_in_j": 0.0, "page_out_j": 0.0, "runtime_s": 0.0}}


@needs_gcc
def test_no_operands_and_no_paging_still_compile(tmp_path):
    header, plan, flash = export(one_node_doc())
    assert "#define POET_NUM_OPERANDS 0u" in header and "POET_OPERANDS[1]" in header
    assert flash.flash_bytes == 0 and flash.lifetime_steps is None
    assert compile_c(tmp_path, header, WALKER, run=True).strip() == "ok 2 0 0"


@needs_gcc
def test_odd_node_names_are_escaped(tmp_path):
    name = 'a"b\\c ??= */ é\t?'
    doc = one_node_doc(name)
    doc["model"] = "tiny */ oops"  # must not end the provenance comment early
    header, _, _ = export(doc)
    out = compile_c(tmp_path, header, WALKER,
                    "-DPOET_WITH_NAMES", "-Wtrigraphs", run=True)
    assert out.splitlines()[0] == f"name {name}"


def test_field_widths_and_prefix_rules():
    assert (_uint(255), _uint(256), _uint(65535), _uint(65536)) == ("uint8_t", "uint16_t", "uint16_t", "uint32_t")
    with pytest.raises(PoetError, match="32-bit"):
        _uint(1 << 32)
    doc = one_node_doc()
    plan, flash = plan_arena(doc), plan_flash(doc)
    for bad in ("9x_", "a-b", "", "é_"):
        with pytest.raises(PoetError, match="not a C identifier prefix"):
            render_header(doc, plan, flash, prefix=bad)
    assert "my_step_t" in render_header(doc, plan, flash, prefix="my_")


# ---------------------------------------------------------------- CLI


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, *needles, out: Path):
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("poet-opt: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


@needs_gcc
def test_export_command_writes_a_header_that_compiles(tmp_path, skip_doc):
    src = tmp_path / "s.json"
    src.write_text(json.dumps(skip_doc))
    out = tmp_path / "inc" / "plan.h"
    result = cli("export", src, "-o", out)
    assert result.exit_code == 0, result.stderr
    plan = plan_arena(skip_doc)
    for needle in (f"{plan.arena_bytes:,} B", f"{plan.ratio:.4f}x", "written per training step", "lifetime",
                   f"wrote    {out}"):
        assert needle in result.stdout
    assert result.stderr == ""
    compile_c(out.parent, out.read_text(), WALKER, run=True)
    assert not list(out.parent.glob(".plan.h.*"))


def test_solve_export_writes_schedule_and_header(tmp_path):
    out, header = tmp_path / "s.json", tmp_path / "s.h"
    result = cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", f"{MLP_RAM}B", "--time-limit", "20", "-q",
                 "--out", out, "--export", header, "--prefix", "MLP_", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    doc = json.loads(out.read_text())
    plan = plan_arena(doc)
    assert summary["export"] == str(header) and summary["arena_bytes"] == plan.arena_bytes
    assert summary["live_peak_bytes"] == doc["totals"]["peak_ram_bytes"]
    assert f"#define MLP_ARENA_BYTES {plan.arena_bytes}u" in header.read_text()


def test_solve_export_fails_before_writing_when_the_arena_does_not_fit(tmp_path, monkeypatch):
    import poet_opt.firmware.arena as arena

    real = arena.plan_arena

    def fragmented(doc):
        plan = real(doc)
        plan.arena_bytes = doc["budgets"]["ram_bytes"] + 1
        return plan

    monkeypatch.setattr(arena, "plan_arena", fragmented)
    out, header = tmp_path / "s.json", tmp_path / "s.h"
    result = cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", f"{MLP_RAM}B", "--time-limit", "20", "-q",
                 "--out", out, "--export", header)
    assert_one_line_error(result, "arena needs", "RAM budget", "live peak", out=header)
    assert not out.exists()


def _tamper_totals(doc):
    doc["totals"]["peak_ram_bytes"] += 1


def _huge_alignment(doc):
    doc["device"]["alignment_bytes"] = 1 << 16  # still a valid schedule; its arena cannot fit the budget


def _no_device(doc):
    del doc["device"]


@pytest.mark.parametrize("content, needles", [
    ("{not json", ["not valid JSON"]),
    (json.dumps([1, 2]), ["not a poet-opt schedule"]),
    ({"format": "poet-opt/schedule@2"}, ["schedule version '2'"]),
    (_tamper_totals, ["not a valid schedule", "totals.peak_ram_bytes"]),
    (_huge_alignment, ["arena needs", "more than the RAM budget", "live peak"]),
    (_no_device, ["no 'device' section"]),
])
def test_export_bad_input_is_one_line_exit_2_and_no_file(tmp_path, skip_doc, content, needles):
    src = tmp_path / "in.json"
    if callable(content):
        doc = json.loads(json.dumps(skip_doc))
        content(doc)
        content = json.dumps(doc)
    elif isinstance(content, dict):
        content = json.dumps({**skip_doc, **content})
    src.write_text(content)
    out = tmp_path / "out.h"
    assert_one_line_error(cli("export", src, "-o", out), str(src), *needles, out=out)


def test_export_bad_prefix_and_missing_file(tmp_path, skip_doc):
    src = tmp_path / "in.json"
    src.write_text(json.dumps(skip_doc))
    out = tmp_path / "out.h"
    assert_one_line_error(cli("export", src, "-o", out, "--prefix", "1x"), "--prefix", "not a C identifier", out=out)
    assert_one_line_error(cli("export", tmp_path / "nope.json", "-o", out), "cannot read", out=out)
    assert_one_line_error(cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", f"{MLP_RAM}B", "--export", out,
                              "--prefix", "a b"), "--prefix", out=out)
    assert_one_line_error(cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", f"{MLP_RAM}B", "--export", out,
                              "--out", tmp_path / "." / "out.h"), "--export", "same file as --out", out=out)
