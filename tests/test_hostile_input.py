"""Hostile and malformed input: numbers too large for any float, YAML built to exhaust the reader,
names that break C comments, outputs that would overwrite inputs, a kill in the middle of a write.
Each ends as the project's rule for bad input says: exactly one line on stderr naming the file and
the field, exit 2, no output file (nor a temporary beside it), and an answer in under 2 seconds.

Runs through the CLI: click's CliRunner where it can, a subprocess where a signal is sent or the
old behaviour was a hang (a subprocess can be given up on; a hang in this process cannot).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import assert_no_output
from poet_opt.cli import main
from poet_opt.device.profiles import PROFILE_DIR

HUGE = 10**399  # 400 digits: no float holds it


def short_id(value):
    return "400-digits" if value == HUGE else None  # None: pytest's own id
SECONDS = 2.0
ZIG = [sys.executable, "-m", "ziglang", "cc"]
STRICT_C = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"]


# ---------------------------------------------------------------- helpers


def cli(*args):
    started = time.perf_counter()
    result = CliRunner().invoke(main, [str(a) for a in args])
    result.seconds = time.perf_counter() - started
    return result


def assert_refused(result, *needles: str, out: Path | None = None, code: int = 2) -> str:
    """Exit `code`, one line on stderr holding every needle, nothing on stdout, no traceback, in
    under 2 s, and no file (nor a `.NAME.*` temporary) at `out`."""
    err = result.stderr
    assert result.exit_code == code, f"exit {result.exit_code}: {err[:500]!r} {result.exception!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines[:5]!r}"
    line = lines[0]
    assert line.startswith("poet-opt: ") and "Traceback" not in err, line
    assert len(line) < 400, line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert result.stdout == "", result.stdout[:500]
    assert result.seconds < SECONDS, f"took {result.seconds:.2f} s"
    if out is not None:
        assert_no_output(out)
    return line


def chain_graph(n_forward: int = 4, **first_node) -> dict:
    """A node-link training graph: a forward chain, a loss, and the backward chain."""
    nodes, links = [], []
    for k in range(n_forward):
        nodes.append({"id": k, "name": f"f{k}", "backward": False, "cost_cpu": 0.01, "cost_ram": 4096})
        if k:
            links.append((k - 1, k))
    loss = n_forward
    nodes.append({"id": loss, "name": "loss", "backward": False, "cost_cpu": 0.001, "cost_ram": 4})
    links.append((loss - 1, loss))
    prev = loss
    for k in reversed(range(n_forward)):
        g = len(nodes)
        nodes.append({"id": g, "name": f"g{k}", "backward": True, "cost_cpu": 0.01, "cost_ram": 4096})
        links += [(prev, g), (k, g)]
        prev = g
    nodes[0].update(first_node)
    return {"directed": True, "graph": {"name": "chain"}, "nodes": nodes,
            "links": [{"source": a, "target": b} for a, b in links]}


def write_json(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def profile_raw() -> dict:
    return yaml.safe_load((PROFILE_DIR / "rpi4.yaml").read_text())


def write_profile(tmp_path: Path, raw) -> Path:
    path = tmp_path / "board.yaml"
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def solve_graph(graph: Path, out: Path, *extra, device="rpi4", ram="1MB"):
    return cli("solve", "--graph", graph, "--device", device, "--ram", ram, "-q", "--time-limit", "20",
               "--out", out, *extra)


@pytest.fixture(scope="module")
def schedule_doc(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("doc") / "s.json"
    graph = write_json(out.with_name("g.json"), chain_graph())
    result = solve_graph(graph, out)
    assert result.exit_code == 0, result.stderr
    return json.loads(out.read_text())


def edited(doc: dict, edit) -> dict:
    doc = json.loads(json.dumps(doc))
    edit(doc)
    return doc


# A small program that runs the CLI's entry point in a fresh interpreter and records how long
# main() took (interpreter start-up excluded), so that a hang can be given up on.
RUNNER = """\
import pathlib, sys, time
from poet_opt.cli import main
started = time.perf_counter()
try:
    main(sys.argv[2:])
finally:
    pathlib.Path(sys.argv[1]).write_text(str(time.perf_counter() - started))
"""


def run_cli_process(tmp_path: Path, *args, timeout: float = 20):
    clock = tmp_path / "seconds.txt"
    try:
        done = subprocess.run([sys.executable, "-c", RUNNER, str(clock), *map(str, args)], capture_output=True,
                              text=True, timeout=timeout, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"poet-opt {' '.join(map(str, args))} still running after {timeout} s")
    return done, float(clock.read_text())


def assert_process_refused(done, seconds: float, *needles: str) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[:500])
    assert len(lines) == 1 and lines[0].startswith("poet-opt: "), lines[:5]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert len(lines[0]) < 400, lines[0]
    assert done.stdout == ""
    assert seconds < SECONDS, f"took {seconds:.2f} s"
    return lines[0]


# ---------------------------------------------------------------- 1. numbers no float holds


@pytest.mark.parametrize("field, value", [
    ("cost_ram", HUGE),
    ("cost_ram", 1e308),  # each fits a float; their sum does not
    ("cost_cpu", HUGE),
    ("cost_cpu", 1.7e308),
], ids=short_id)
def test_graph_number_too_large_names_the_node_field(tmp_path, field, value):
    graph = chain_graph()
    for node in graph["nodes"]:
        node[field] = value
    path, out = write_json(tmp_path / "g.json", graph), tmp_path / "s.json"
    assert_refused(solve_graph(path, out), "g.json", f"nodes[0].{field}", "at most", out=out)


def test_graph_sizes_adding_up_past_64_bits_are_refused(tmp_path):
    graph = chain_graph()
    for node in graph["nodes"]:
        node["cost_ram"] = 2**62
    path, out = write_json(tmp_path / "g.json", graph), tmp_path / "s.json"
    assert_refused(solve_graph(path, out), "g.json", "nodes.bytes", "2^63", out=out)


def test_graph_integer_beyond_pythons_digit_limit(tmp_path):
    path, out = tmp_path / "g.json", tmp_path / "s.json"
    path.write_text(json.dumps(chain_graph()).replace('"cost_ram": 4096', '"cost_ram": ' + "9" * 5000, 1))
    assert_refused(solve_graph(path, out), "g.json", "digits", out=out)


@pytest.mark.parametrize("section, key, value", [
    ("memory", "ram_bytes", HUGE),
    ("storage", "erase_block_bytes", HUGE),
    ("storage", "endurance_cycles", HUGE),
    ("compute", "flops_per_second", HUGE),
    ("compute", "flops_per_second", 1e-300),  # every compute time would be inf
    ("compute", "active_power_w", 1e300),  # every energy would be inf
], ids=short_id)
def test_profile_number_out_of_range_names_the_field(tmp_path, section, key, value):
    raw = profile_raw()
    raw[section][key] = value
    path, out = write_profile(tmp_path, raw), tmp_path / "s.json"
    assert_refused(cli("solve", "--model", "mlp", "--device", path, "--ram", "1MB", "--out", out),
                   "board.yaml", f"{section}.{key}", out=out)


@pytest.mark.parametrize("where, edit", [
    ("node 0", lambda d: d["graph"]["nodes"][0].__setitem__("bytes", HUGE)),
    ("budgets.ram_bytes", lambda d: d["budgets"].__setitem__("ram_bytes", HUGE)),
    ("totals.computes", lambda d: d["totals"].__setitem__("computes", -HUGE)),
    ("compute_s", lambda d: [n.__setitem__("compute_s", 1e308) for n in d["graph"]["nodes"]]),  # sum: inf
    ("page_in_j", lambda d: [n.__setitem__("page_in_j", 1.7e308) for n in d["graph"]["nodes"]]),
])
@pytest.mark.parametrize("command", ["validate", "export"])
def test_schedule_number_too_large_names_the_field(tmp_path, schedule_doc, where, edit, command):
    path, out = write_json(tmp_path / "s.json", edited(schedule_doc, edit)), tmp_path / "plan.h"
    args = ["validate", path] if command == "validate" else ["export", path, "-o", out]
    assert_refused(cli(*args), "s.json", where, "expected at most", out=out)


def test_schedule_integer_beyond_pythons_digit_limit(tmp_path, schedule_doc):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schedule_doc).replace('"ram_bytes": ', '"ram_bytes": ' + "9" * 5000 + ", \"x\": ", 1))
    assert_refused(cli("validate", path), "s.json", "digits")


# ---------------------------------------------------------------- 2. YAML and JSON built to exhaust the reader


def laughs(levels: int = 9, indent: str = "") -> str:
    """The "billion laughs": each anchor is nine aliases of the one before, 9^levels strings."""
    lines = [f'{indent}l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{indent}l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 9)}]" for k in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,
    "name: " + "{a: " * 100_000 + "1" + "}" * 100_000,
    "compute:\n" + "".join(" " * k + "a:\n" for k in range(1, 200)),
])
def test_deeply_nested_profile_is_refused(tmp_path, text):
    path, out = write_profile(tmp_path, text), tmp_path / "s.json"
    assert_refused(cli("solve", "--model", "mlp", "--device", path, "--ram", "1MB", "--out", out),
                   "board.yaml", "line", "64 levels", out=out)


def test_alias_bomb_profile_is_refused_not_a_hang(tmp_path):
    path = write_profile(tmp_path, laughs() + "description: *l9\n")
    done, seconds = run_cli_process(tmp_path, "solve", "--model", "mlp", "--device", path, "--ram", "1MB",
                                    "--out", tmp_path / "s.json")
    assert_process_refused(done, seconds, "board.yaml", "line", "alias")
    assert_no_output(tmp_path / "s.json")


def test_alias_bomb_cost_file_is_refused_not_a_hang(tmp_path):
    costs = tmp_path / "costs.yaml"
    costs.write_text("relu:\n  time_s:\n" + laughs(indent="    "))
    done, seconds = run_cli_process(tmp_path, "solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB",
                                    "--costs", costs, "--out", tmp_path / "s.json")
    assert_process_refused(done, seconds, "costs.yaml", "line", "alias")


def test_deeply_nested_cost_file_is_refused(tmp_path):
    costs = tmp_path / "costs.yaml"
    costs.write_text("[" * 100_000 + "]" * 100_000)
    out = tmp_path / "s.json"
    assert_refused(cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--costs", costs,
                       "--out", out), "costs.yaml", "line", "64 levels", out=out)


@pytest.mark.parametrize("command", ["graph", "validate"])
@pytest.mark.parametrize("text", ["[" * 100_000, '{"nodes": ' + "[" * 100_000 + "]" * 100_000 + "}"])
def test_deeply_nested_json_is_one_line(tmp_path, command, text):
    # these passed before too: kept so that a new reader cannot lose it
    path, out = tmp_path / "deep.json", tmp_path / "s.json"
    path.write_text(text)
    result = solve_graph(path, out) if command == "graph" else cli("validate", path)
    assert_refused(result, "deep.json", "nested too deeply", out=out)


# ---------------------------------------------------------------- 3. names that break C


HOSTILE_NAMES = ["a*/b", "c/*d", "e\nf", "g\x00h", "ünï€😀", "tri??/", "back\\", "x*", "/y", "*/*/"]


NAMES_PROGRAM = r"""#define POET_WITH_NAMES
#include "HEADER"
#include <stdio.h>
int main(void) {
    unsigned k;
    const char *p;
    for (k = 0; k < POET_NUM_TENSORS; k++) {
        for (p = POET_NODE_NAMES[k]; *p; p++) printf("%02x", (unsigned)(unsigned char)*p);
        printf("\n");
    }
    return 0;
}
"""


def compile_header(tmp_path: Path, header: Path, run: bool = False) -> list[str]:
    """Compile a program including the header under strict C99; with run, run it and return the
    node names as the C strings hold them (printed in hex: a name may hold a newline)."""
    source = tmp_path / "main.c"
    source.write_text(NAMES_PROGRAM.replace("HEADER", header.name))
    target = tmp_path / ("main" if run else "main.o")
    cmd = [*ZIG, *STRICT_C, "-I", str(header.parent), str(source), "-o", str(target)] + ([] if run else ["-c"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    if not run:
        return []
    printed = subprocess.run([str(target)], capture_output=True, text=True, timeout=60, check=True).stdout
    return [bytes.fromhex(line).decode("utf-8", "surrogatepass") for line in printed.splitlines()]


@pytest.mark.parametrize("surrogate", [False, True])
def test_hostile_names_make_a_header_that_compiles_strictly(tmp_path, surrogate):
    pytest.importorskip("ziglang")
    names = HOSTILE_NAMES + (["\ud800lone"] if surrogate else [])
    graph = chain_graph(len(names) // 2)
    assert len(graph["nodes"]) >= len(names)
    for node, name in zip(graph["nodes"], names):
        node["name"] = name
    graph["graph"]["name"] = "graph */ /* \x00 ??/ é \\"
    graph_file = tmp_path / "g*??=.json"
    graph_file.write_text(json.dumps(graph))  # ASCII: lone surrogates as \ud800 escapes
    raw = profile_raw()
    raw.update(name="board */", cpu="cpu /* \t ??/ \\")
    device = write_profile(tmp_path, raw)
    out, header = tmp_path / "s.json", tmp_path / "plan.h"
    result = solve_graph(graph_file, out, "--export", header, device=device)
    assert result.exit_code == 0, result.stderr
    compile_header(tmp_path, header)
    again = tmp_path / "again.h"
    result = cli("export", out, "-o", again)
    assert result.exit_code == 0 and result.seconds < SECONDS, result.stderr
    printed = compile_header(tmp_path, again, run=True)
    # the C strings hold the names, byte for byte (up to a NUL, where a C string ends)
    assert printed == [n["name"].split("\x00")[0] for n in json.loads(out.read_text())["graph"]["nodes"]]


# ---------------------------------------------------------------- 4. alignment


def test_profile_alignment_must_be_a_power_of_two(tmp_path):
    raw = profile_raw()
    raw["memory"]["alignment_bytes"] = 3
    path, out = write_profile(tmp_path, raw), tmp_path / "s.json"
    assert_refused(cli("solve", "--model", "mlp", "--device", path, "--ram", "1MB", "--out", out),
                   "board.yaml", "memory.alignment_bytes", "power of two", out=out)


@pytest.mark.parametrize("alignment", [3, 24, HUGE], ids=short_id)
def test_schedule_alignment_must_be_a_power_of_two_to_export(tmp_path, schedule_doc, alignment):
    doc = edited(schedule_doc, lambda d: d["device"].__setitem__("alignment_bytes", alignment))
    path, out = write_json(tmp_path / "s.json", doc), tmp_path / "plan.h"
    assert_refused(cli("export", path, "-o", out), "s.json", "device.alignment_bytes", out=out)


# ---------------------------------------------------------------- 5. a runtime budget nothing can meet


@pytest.mark.parametrize("runtime", ["0.5x", "0.99x", "1us"])
def test_pareto_runtime_below_plain_training_everywhere_is_bad_input(tmp_path, runtime):
    out = tmp_path / "sweep"
    result = cli("pareto", "--model", "mlp", "--device", "rpi4", "--device", "nrf52840", "--ram", "100KB,1MB",
                 "--runtime", runtime, "-q", "-o", out)
    assert_refused(result, "--runtime", "below plain training")
    assert not out.exists()


def test_pareto_runtime_one_device_misses_is_reported_as_infeasible(tmp_path):
    # 100 ms: the mlp trains in 13 ms on the Pi 4 and 253 ms on the nRF52840
    out = tmp_path / "sweep"
    result = cli("pareto", "--model", "mlp", "--device", "rpi4", "--device", "nrf52840", "--ram", "100KB,1MB",
                 "--runtime", "100ms", "-q", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "nrf52840 (joint): infeasible: --runtime" in result.stdout
    from poet_opt.pareto import read_csv

    rows = read_csv(out / "pareto.csv")
    assert {r["device"]: r["status"] for r in rows} == {"rpi4": "optimal", "nrf52840": "infeasible"}
    assert all("below plain training" in r["error"] for r in rows if r["device"] == "nrf52840")


# ---------------------------------------------------------------- 6. click's usage errors


@pytest.mark.parametrize("args, needles", [
    (["solve", "--model", "mlp", "--ram", "1MB"], ["'--device'"]),
    (["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--colour", "red"], ["--colour"]),
    (["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--mode", "fast"], ["'--mode'", "'fast'"]),
    (["export", "s.json"], ["'-o'"]),
    (["validate"], ["'SCHEDULE_FILE'"]),
    (["frobnicate"], ["'frobnicate'"]),
])
def test_usage_errors_are_one_line(args, needles):
    line = assert_refused(cli(*args), *needles)
    assert "--help" in line


def test_help_still_works():
    for args in (["--help"], ["solve", "--help"], ["--version"]):
        result = cli(*args)
        assert result.exit_code == 0 and result.stderr == "", result.stderr
        assert "Usage:" in result.stdout or "version" in result.stdout


# ---------------------------------------------------------------- 7. an output that is an input


def test_out_equal_to_the_graph_is_refused_and_the_graph_kept(tmp_path):
    graph = write_json(tmp_path / "g.json", chain_graph())
    before = graph.read_text()
    os.link(graph, tmp_path / "hard.json")
    (tmp_path / "soft.json").symlink_to(graph)
    for out in (graph, tmp_path / "." / "g.json", tmp_path / "hard.json", tmp_path / "soft.json"):
        assert_refused(solve_graph(graph, out), "--out", "--graph")
        assert_refused(solve_graph(graph, tmp_path / "s.json", "--export", out), "--export", "--graph")
    assert graph.read_text() == before


def test_out_equal_to_the_profile_or_the_cost_file_is_refused(tmp_path):
    device = write_profile(tmp_path, profile_raw())
    costs = tmp_path / "costs.yaml"
    costs.write_text("relu: {time_s: 0.001}\n")
    kept = device.read_text(), costs.read_text()
    base = ["solve", "--model", "mlp", "--device", device, "--ram", "1MB", "-q"]
    assert_refused(cli(*base, "--out", device), "--out", "--device")
    assert_refused(cli(*base, "--costs", costs, "--out", costs), "--out", "--costs")
    assert (device.read_text(), costs.read_text()) == kept


def test_export_equal_to_out_is_refused(tmp_path):
    graph = write_json(tmp_path / "g.json", chain_graph())
    out = tmp_path / "s.json"
    assert_refused(solve_graph(graph, out, "--export", tmp_path / "." / "s.json"), "--export", "--out", out=out)


def test_export_and_plot_onto_their_own_input_are_refused(tmp_path, schedule_doc):
    path = write_json(tmp_path / "s.json", schedule_doc)
    before = path.read_text()
    assert_refused(cli("export", path, "-o", path), "-o", "SCHEDULE_FILE")
    image = write_json(tmp_path / "s.png", schedule_doc)  # a schedule with an odd name
    assert_refused(cli("plot", image, "-o", tmp_path / "s.svg"), "-o", "SCHEDULE_FILE")  # the .png beside it
    assert path.read_text() == before and image.read_text() == before
    assert not (tmp_path / "s.svg").exists()


def test_pareto_outputs_onto_inputs_are_refused(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    graph = write_json(sweep / "pareto.csv", chain_graph())
    before = graph.read_text()
    assert_refused(cli("pareto", "--graph", graph, "--device", "rpi4", "--ram", "1MB", "-q", "-o", sweep),
                   "-o", "--graph")
    assert_refused(cli("pareto", "--graph", graph, "--device", "rpi4", "--ram", "1MB", "-q", "-o", graph),
                   "-o", "--graph")
    assert graph.read_text() == before


# ---------------------------------------------------------------- 8. a kill in the middle of a write


# Runs the CLI with one writer made slow: it writes part of the file, says so on stdout, and
# waits to be killed. The patch lives in this test's subprocess only; the tool has no hook for it.
SLOW_WRITER = """\
import sys, time
{patch}
from poet_opt.cli import main
main(sys.argv[1:])
"""
SLOW_JSON = """\
import poet_opt.files
def slow_dump(doc, fh, **kw):
    fh.write('{"format": "half a schedule",')
    fh.flush()
    print("writing", flush=True)
    time.sleep(60)
poet_opt.files.json.dump = slow_dump
"""
SLOW_CSV = """\
import csv
write_row = csv.DictWriter.writerow
def slow_row(self, row):
    write_row(self, row)
    print("writing", flush=True)
    time.sleep(60)
csv.DictWriter.writerow = slow_row
"""


def kill_while_writing(tmp_path: Path, patch: str, *args) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER.format(patch=patch), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGTERM)
        started = time.perf_counter()
        stdout, stderr = proc.communicate(timeout=20)
        assert time.perf_counter() - started < SECONDS
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_sigterm_while_writing_the_schedule_leaves_nothing(tmp_path):
    out = tmp_path / "s.json"
    done = kill_while_writing(tmp_path, SLOW_JSON, "solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB",
                              "-q", "--out", out)
    assert done.returncode == 128 + signal.SIGTERM, (done.returncode, done.stderr)
    assert done.stderr.splitlines() == ["poet-opt: terminated; nothing was written"]
    assert_no_output(out)


def test_sigterm_while_writing_the_pareto_csv_leaves_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    done = kill_while_writing(tmp_path, SLOW_CSV, "pareto", "--model", "mlp", "--device", "rpi4", "--ram", "1MB",
                              "--jobs", "1", "-q", "-o", sweep)
    assert done.returncode == 128 + signal.SIGTERM, (done.returncode, done.stderr)
    assert len(done.stderr.splitlines()) == 1 and "terminated" in done.stderr
    assert_no_output(sweep / "pareto.csv")


# ---------------------------------------------------------------- 9. a gradient read by a forward node


def gradient_feeds_forward() -> dict:
    """The chain graph plus forward nodes h -> h2 that read the gradient g2 and are read by later
    gradients: node-link graphs allow it, and the DTR baseline used to lose the gradient."""
    graph = chain_graph(6)
    nodes = graph["nodes"]
    by_name = {n["name"]: n["id"] for n in nodes}
    h, h2 = len(nodes), len(nodes) + 1
    nodes += [{"id": h, "name": "h", "backward": False, "cost_cpu": 0.01, "cost_ram": 4096},
              {"id": h2, "name": "h2", "backward": False, "cost_cpu": 0.01, "cost_ram": 4096}]
    graph["links"] += [{"source": by_name["g4"], "target": h}, {"source": h, "target": h2},
                       {"source": h2, "target": by_name["g1"]}, {"source": h, "target": by_name["g0"]}]
    return graph


def test_dtr_applies_to_a_graph_where_a_gradient_feeds_a_forward_node(tmp_path):
    from poet_opt.device.costs import node_costs
    from poet_opt.device.profiles import load_profile
    from poet_opt.model.node_link import load_node_link
    from poet_opt.schedule.decisions import Budgets
    from poet_opt.solver.baselines import dtr_decisions, evaluate

    graph = load_node_link(write_json(tmp_path / "g.json", gradient_feeds_forward()))
    profile = load_profile("rpi4")
    costs = node_costs(graph, profile)
    fitted = 0
    for ram in range(graph.min_working_set_bytes(), graph.plain_peak_bytes() + 1, 1024):
        decisions = dtr_decisions(graph, costs, ram)  # used to raise RuntimeError: dtr lost gradient
        if decisions is not None:
            result = evaluate(graph, profile, costs, Budgets(ram, float("inf"), 1 << 40), "dtr", decisions)
            fitted += result.fits
    assert fitted


@pytest.mark.parametrize("ram", ["17KB", "19KB", "22KB"])
def test_solve_on_a_graph_where_a_gradient_feeds_a_forward_node(tmp_path, ram):
    graph = write_json(tmp_path / "g.json", gradient_feeds_forward())
    out = tmp_path / "s.json"
    result = solve_graph(graph, out, ram=ram)
    assert result.exit_code == 0, result.stderr
    assert cli("validate", out).exit_code == 0
