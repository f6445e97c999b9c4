"""The `poet-opt` command line: happy paths end to end, and the project's rule for bad input --
exactly one line on stderr naming the problem, the file (where there is one) and the field; exit 2
(1 for a schedule that breaks a rule); no traceback; no output file and no temporary file left
behind. Click's own usage errors too: one line naming the option, exit 2.

A few cases run the real process (``python -m poet_opt.cli`` and the console script); the rest use
click's CliRunner, which is much faster. Budgets are chosen relative to the graphs' own plain peak.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import assert_no_output
from poet_opt.cli import main
from poet_opt.model.node_link import load_node_link
from poet_opt.device.profiles import PROFILE_DIR, builtin_profile_names
from poet_opt.model.zoo import MODELS, build_model

ROOT = Path(__file__).resolve().parents[1]
SHARED_GRAPHS = Path(__file__).resolve().parents[2] / "shared" / "graphs"
SMALL_GRAPH = SHARED_GRAPHS / "random_training_s1_n8.json"
BUILTIN_DEVICES = {"mkr1000", "nrf52840", "stm32f746", "rpi4", "rpi4-nocache", "rpi3", "jetson-tx2", "jetson-nano"}
FAST = ["--time-limit", "20"]

MLP = build_model("mlp")
PLAIN_PEAK = MLP.plain_peak_bytes()  # the mlp's working memory when training plainly
MIN_WORKING_SET = MLP.min_working_set_bytes()  # no schedule can go below this
BELOW_PLAIN = (PLAIN_PEAK + MIN_WORKING_SET) // 2  # needs remat or paging, and some schedule fits


# ---------------------------------------------------------------- helpers


def cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def solve_args(*extra, ram=BELOW_PLAIN, model="mlp", device="rpi4"):
    return ["solve", "--model", model, "--device", device, "--ram", f"{ram}B" if isinstance(ram, int) else str(ram), *FAST, *extra]


def assert_one_line_error(result, *needles: str, code: int = 2, out: Path | None = None) -> str:
    """Exit `code`, nothing on stdout, one line on stderr containing every needle, no traceback,
    and no file (nor a temporary `.NAME.*` beside it) at `out`."""
    err, stdout = result.stderr, result.stdout
    assert result.exit_code == code, f"exit {result.exit_code}, stderr: {err!r}, exception: {result.exception!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in err and "Traceback" not in stdout
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    line = lines[0]
    assert line.startswith("poet-opt: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert stdout == "", stdout
    if out is not None:
        assert_no_output(out)
    return line


def assert_usage_error(result, *needles: str) -> None:
    """Click's own usage errors: exit 2 and one line naming the option and where the help is, as
    for every other error (click's own form is three lines: Usage, Try, Error)."""
    line = assert_one_line_error(result, *needles)
    assert "Usage:" not in line and "--help" in line


@pytest.fixture(scope="module")
def good_doc() -> dict:
    """A schedule for the mlp below its plain peak, from the library (the CLI path is tested below)."""
    from poet_opt.solver.driver import solve

    return solve(MLP, "rpi4", ram=BELOW_PLAIN, runtime="1.5x", time_limit=20, model_name="mlp").to_dict()


def write_doc(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def rpi4_yaml() -> dict:
    return yaml.safe_load((PROFILE_DIR / "rpi4.yaml").read_text())


# ---------------------------------------------------------------- happy paths


def test_module_entry_point_solves_below_plain_peak_and_the_schedule_validates(tmp_path):
    """End to end in real processes: `python -m poet_opt.cli solve ... --out tmp/x.json`, then the
    console script (or the module) validates what it wrote."""
    out = tmp_path / "tmp" / "x.json"
    run = subprocess.run([sys.executable, "-m", "poet_opt.cli", *solve_args("--runtime", "1.5x", "--out", out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert f"wrote    {out}" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "poet-opt/schedule@1"
    assert doc["model"] == "mlp" and doc["device"]["name"] == "rpi4" and doc["mode"] == "joint"
    assert doc["budgets"]["ram_bytes"] == BELOW_PLAIN
    assert doc["totals"]["peak_ram_bytes"] <= BELOW_PLAIN < doc["plain"]["peak_ram_bytes"] == PLAIN_PEAK
    assert doc["totals"]["runtime_s"] <= doc["budgets"]["runtime_s"] * (1 + 1e-9)
    assert doc["budgets"]["runtime_s"] == pytest.approx(1.5 * doc["plain"]["runtime_s"])
    assert not list(out.parent.glob(".x.json.*"))

    script = Path(sys.executable).parent / "poet-opt"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "poet_opt.cli"]
    check = subprocess.run([*command, "validate", str(out)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert check.stderr == ""
    assert check.stdout.startswith(f"{out}: valid: ")


def test_module_entry_point_reports_bad_input_in_one_line(tmp_path):
    out = tmp_path / "x.json"
    run = subprocess.run([sys.executable, "-m", "poet_opt.cli", *solve_args("--out", out, ram="-1MB")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [run.stderr.strip()] and "--ram" in run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    assert_no_output(out)


def test_version():
    result = cli("--version")
    assert result.exit_code == 0 and "poet-opt" in result.stdout


def test_json_summary_parses_and_carries_totals(tmp_path):
    out = tmp_path / "s.json"
    result = cli(*solve_args("--runtime", "1.5x", "--json", "--out", out))
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["model"] == "mlp" and summary["device"] == "rpi4"
    assert summary["budgets"]["ram_bytes"] == BELOW_PLAIN
    totals = summary["totals"]
    assert {"energy_j", "runtime_s", "peak_ram_bytes", "computes", "page_ins"} <= totals.keys()
    assert 0 < totals["peak_ram_bytes"] <= BELOW_PLAIN
    assert summary["out"] == str(out)
    assert json.loads(out.read_text())["totals"] == totals


def test_solve_without_out_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli(*solve_args("-q"))
    assert result.exit_code == 0, result.stderr
    assert "RAM      peak" in result.stdout and "wrote" not in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_validate_accepts_a_solved_schedule(tmp_path, good_doc):
    path = write_doc(tmp_path / "good.json", good_doc)
    result = cli("validate", path)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"{path}: valid: ") and result.stderr == ""


def test_validate_refuses_a_schedule_without_a_ram_budget(tmp_path, good_doc):
    # only runtime_s may be null (docs/schedule-format.md): every plan has a RAM budget, which its
    # header's arena is checked against (issue 28)
    doc = json.loads(json.dumps(good_doc))
    doc["budgets"]["ram_bytes"] = None
    result = cli("validate", write_doc(tmp_path / "noram.json", doc))
    assert result.exit_code == 2, result.stderr
    assert "budgets.ram_bytes is null" in result.stderr and result.stdout == ""


def test_devices_lists_every_builtin_profile():
    result = cli("devices")
    assert result.exit_code == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines()[1:] if line.strip()}
    assert BUILTIN_DEVICES <= listed
    assert set(builtin_profile_names()) <= listed


def test_models_lists_the_whole_zoo():
    result = cli("models")
    assert result.exit_code == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines()[1:] if line.strip()}
    assert set(MODELS) <= listed
    assert "mlp" in listed and "mcu-vww" in listed


@pytest.mark.skipif(not SMALL_GRAPH.exists(), reason="shared graphs not present")
def test_graph_file_solves(tmp_path):
    graph = load_node_link(SMALL_GRAPH)
    ram = (graph.plain_peak_bytes() + graph.min_working_set_bytes()) // 2
    out = tmp_path / "g.json"
    result = cli("solve", "--graph", SMALL_GRAPH, "--device", "rpi4", "--ram", f"{ram}B", "--runtime", "1.5x",
                 "--out", out, "-q", *FAST)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["model"] == SMALL_GRAPH.stem and len(doc["graph"]["nodes"]) == len(graph)
    assert doc["totals"]["peak_ram_bytes"] <= ram
    assert cli("validate", out).exit_code == 0


def test_microcontroller_model_solves(tmp_path):
    plain = build_model("mcu-vww").plain_peak_bytes()
    out = tmp_path / "vww.json"
    result = cli(*solve_args("--out", out, "-q", "--gap", "0.05", model="mcu-vww", device="stm32f746",
                             ram=int(plain * 0.85)))
    assert result.exit_code == 0, result.stderr
    assert cli("validate", out).exit_code == 0


def test_user_yaml_profile_works_like_a_name(tmp_path):
    path = tmp_path / "board.yaml"
    path.write_text(yaml.safe_dump({**rpi4_yaml(), "name": "my-board"}))
    result = cli(*solve_args("--json", device=path))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["device"] == "my-board"


# ---------------------------------------------------------------- malformed device profiles


def _profile(tmp_path: Path, edit) -> Path:
    raw = rpi4_yaml()
    edit(raw)
    path = tmp_path / "board.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("edit, field, says", [
    (lambda d: d["compute"].pop("flops_per_second"), "compute.flops_per_second", "missing"),
    (lambda d: d.pop("storage"), "storage", "missing"),
    (lambda d: d["storage"]["read"].__setitem__("bytes_per_second", -5), "storage.read.bytes_per_second", "-5"),
    (lambda d: d["compute"].__setitem__("active_power_w", "lots"), "compute.active_power_w", "lots"),
    (lambda d: d["memory"].__setitem__("ram_bytes", "-4GiB"), "memory.ram_bytes", "positive"),
    (lambda d: d["memory"].__setitem__("ram_bytes", "4 parsecs"), "memory.ram_bytes", "unit"),
    (lambda d: d["memory"].__setitem__("bytes_per_element", 3), "memory.bytes_per_element", "3"),
    (lambda d: d["compute"].__setitem__("active_power_w", True), "compute.active_power_w", "True"),
    (lambda d: d["storage"].__setitem__("kind", "floppy"), "storage.kind", "floppy"),
    (lambda d: d["compute"].__setitem__("flops_per_secnd", 1), "compute.flops_per_secnd", "unknown field"),
])
def test_malformed_profile(tmp_path, edit, field, says):
    path = _profile(tmp_path, edit)
    out = tmp_path / "x.json"
    line = assert_one_line_error(cli(*solve_args("--out", out, device=path)), str(path), field, says, out=out)
    assert "Input should" not in line or "(got" in line


@pytest.mark.parametrize("text, says", [
    ("name: [unclosed\n", "not valid YAML at line"),
    ("", "empty"),
    ("# just a comment\n", "empty"),
    ("- a\n- b\n", "mapping"),
    ("just a string\n", "mapping"),
])
def test_profile_that_is_not_a_yaml_mapping(tmp_path, text, says):
    path = tmp_path / "board.yaml"
    path.write_text(text)
    out = tmp_path / "x.json"
    assert_one_line_error(cli(*solve_args("--out", out, device=path)), str(path), says, out=out)


def test_missing_profile_file(tmp_path):
    path = tmp_path / "nope.yaml"
    assert_one_line_error(cli(*solve_args(device=path)), "nope.yaml", "no such profile file")


# ---------------------------------------------------------------- unknown names


@pytest.mark.parametrize("name, suggests", [
    ("rpi5", ["rpi4", "rpi3"]),
    ("jetson", ["jetson-nano", "jetson-tx2"]),
    ("stm32", ["stm32f746"]),
    ("toaster", sorted(BUILTIN_DEVICES)),  # nothing close: every known name
])
def test_unknown_device_suggests_close_names(tmp_path, name, suggests):
    out = tmp_path / "x.json"
    assert_one_line_error(cli(*solve_args("--out", out, device=name)), "--device", repr(name), *suggests, out=out)


@pytest.mark.parametrize("name, suggests", [
    ("mpl", ["mlp"]),
    ("resnet", ["resnet18-cifar", "resnet50"]),
    ("vgg", ["vgg16-cifar"]),
    ("alexnet", list(MODELS)),
])
def test_unknown_model_suggests_close_names(tmp_path, name, suggests):
    out = tmp_path / "x.json"
    assert_one_line_error(cli(*solve_args("--out", out, model=name)), "--model", repr(name), *suggests, out=out)


# ---------------------------------------------------------------- graph files


def _graph(tmp_path: Path, nodes, links, name="g.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"directed": True, "nodes": nodes, "links": links}))
    return path


def _node(i, backward=False, ram=1024):
    return {"id": i, "name": f"n{i}", "backward": backward, "cost_cpu": 0.01, "cost_ram": ram}


GRAPH_CASES = {
    "cycle": ([_node(0), _node(1), _node(2, True)],
              [{"source": 0, "target": 1}, {"source": 1, "target": 2}, {"source": 2, "target": 1}],
              ["links", "cycle"]),
    "dangling edge": ([_node(0), _node(1, True)], [{"source": 0, "target": 1}, {"source": 1, "target": 7}],
                      ["links[1].target", "7"]),
    "duplicate id": ([_node(0), _node(1), _node(1, True)], [{"source": 0, "target": 1}],
                     ["nodes[2].id", "duplicate"]),
    "negative size": ([_node(0, ram=-8), _node(1, True)], [{"source": 0, "target": 1}],
                      ["nodes[0].cost_ram", ">= 0"]),
    "missing size": ([{"id": 0}, _node(1, True)], [{"source": 0, "target": 1}], ["nodes[0].cost_ram", "missing"]),
    "text size": ([_node(0, ram="big"), _node(1, True)], [], ["nodes[0].cost_ram", "'big'"]),
    "self-loop": ([_node(0), _node(1, True)], [{"source": 1, "target": 1}], ["links[0]", "self-loop"]),
    "no nodes": ([], [], ["nodes", "no nodes"]),
}


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_bad_graph_file(tmp_path, case):
    nodes, links, needles = GRAPH_CASES[case]
    path = _graph(tmp_path, nodes, links)
    out = tmp_path / "x.json"
    result = cli("solve", "--graph", path, "--device", "rpi4", "--ram", "1MB", "--out", out, *FAST)
    assert_one_line_error(result, "g.json", *needles, out=out)


@pytest.mark.parametrize("text, needles", [
    ('{"nodes": [', ["not valid JSON", "line 1"]),
    ("", ["not valid JSON"]),
    ("[1, 2]", ["(top level)"]),
    ('{"links": []}', ["nodes", "missing"]),
])
def test_graph_file_that_is_not_a_node_link_document(tmp_path, text, needles):
    path = tmp_path / "g.json"
    path.write_text(text)
    out = tmp_path / "x.json"
    result = cli("solve", "--graph", path, "--device", "rpi4", "--ram", "1MB", "--out", out)
    assert_one_line_error(result, "g.json", *needles, out=out)


def test_missing_graph_file(tmp_path):
    assert_one_line_error(cli("solve", "--graph", tmp_path / "none.json", "--device", "rpi4", "--ram", "1MB"),
                          "none.json", "no such graph file")


@pytest.mark.parametrize("which", [[], ["--model", "mlp", "--graph", "x.json"]])
def test_exactly_one_of_model_and_graph(which):
    assert_one_line_error(cli("solve", *which, "--device", "rpi4", "--ram", "1MB"), "--model", "--graph")


# ---------------------------------------------------------------- budgets


@pytest.mark.parametrize("ram, says", [
    ("-1MB", "positive"),
    ("-5", "positive"),
    ("0", "positive"),
    ("abc", "cannot read 'abc'"),
    ("", "cannot read"),
    ("1.5XB", "unknown size unit 'XB'"),
    ("nan", "cannot read"),
    ("inf", "cannot read"),
    ("1e400", "too large"),
    ("0.4", "less than one byte"),
])
def test_bad_ram_budget(tmp_path, ram, says):
    out = tmp_path / "x.json"
    assert_one_line_error(cli(*solve_args("--out", out, ram=ram)), "--ram", says, out=out)


@pytest.mark.parametrize("runtime, says", [
    ("-1x", "positive"),
    ("0x", "positive"),
    ("fast", "cannot read 'fast'"),
    ("1.2", "no unit"),
    ("", "cannot read"),
    ("nan", "cannot read"),
    ("1e999s", "too large"),
    ("3 fortnights", "unknown runtime unit"),
    ("0.5x", "below plain training"),
    ("1ms", "below plain training"),
])
def test_bad_runtime_budget(tmp_path, runtime, says):
    out = tmp_path / "x.json"
    assert_one_line_error(cli(*solve_args("--runtime", runtime, "--out", out)), "--runtime", says, out=out)


def _smallest(line: str) -> int:
    match = re.search(r"smallest feasible budget is \S+ \S+ \((\d+) B\)", line)
    assert match, line
    return int(match.group(1))


def test_infeasible_ram_names_the_smallest_feasible_budget(tmp_path):
    """The brief's example: `--model mlp --device rpi4 --ram 1KB`, without -q (no progress may show)."""
    out = tmp_path / "x.json"
    line = assert_one_line_error(cli("solve", "--model", "mlp", "--device", "rpi4", "--ram", "1KB", "--out", out),
                                 "--ram", "no schedule fits", out=out)
    smallest = _smallest(line)
    assert MIN_WORKING_SET <= smallest <= PLAIN_PEAK
    # ... and it is the smallest: a schedule exists there, none a byte below.
    assert cli(*solve_args("-q", ram=smallest)).exit_code == 0
    assert_one_line_error(cli(*solve_args("-q", ram=smallest - 1)), "no schedule fits", "--ram")


@pytest.mark.parametrize("extra", [["--mode", "none"], ["--mode", "remat", "--runtime", "1x"]])
def test_infeasible_without_remat_or_paging_names_the_plain_peak(tmp_path, extra):
    out = tmp_path / "x.json"
    line = assert_one_line_error(cli(*solve_args(*extra, "--out", out)), "--ram", "no schedule fits", out=out)
    assert _smallest(line) == PLAIN_PEAK


@pytest.mark.parametrize("option, value", [("--time-limit", "-1"), ("--time-limit", "0"), ("--gap", "-0.1"),
                                           ("--gap", "nan")])
def test_bad_solver_settings(option, value):
    assert_one_line_error(cli(*solve_args(option, value)), option)


# ---------------------------------------------------------------- --out


def test_out_under_a_file(tmp_path, no_solving):
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile" / "x.json", tmp_path / "afile" / "sub" / "x.json"):
        assert_one_line_error(cli(*solve_args("--out", out)), "--out", "is a file, not a directory", str(out))
    assert (tmp_path / "afile").read_text() == ""


def test_out_that_is_not_a_regular_file(tmp_path, no_solving):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    assert_one_line_error(cli(*solve_args("--out", fifo)), "--out", "not a regular file", "pipe.json")
    assert fifo.exists() and not fifo.is_file()


def test_out_in_an_unwritable_directory(tmp_path, no_solving):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permission bits do not stop us")
        out = locked / "x.json"
        assert_one_line_error(cli(*solve_args("--out", out)), "--out", "cannot write", out=out)
    finally:
        locked.chmod(0o700)


@pytest.fixture
def no_solving(monkeypatch):
    """--out problems must be found before a (possibly long) solve, not after it."""
    import poet_opt.solver.driver as solve_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("solved before checking --out")

    monkeypatch.setattr(solve_module, "solve", must_not_run)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_out_on_a_filesystem_that_refuses_files(no_solving):
    # /proc takes no new files, even from root (permission bits cannot tell): the CLI tries.
    out = Path("/proc/poet-opt-test.json")
    assert_one_line_error(cli(*solve_args("--out", out)), "--out", "cannot write", str(out), out=out)


def test_out_that_is_a_directory_is_a_usage_error(tmp_path):
    assert_usage_error(cli(*solve_args("--out", tmp_path)), "--out", "is a directory")


def test_failed_write_leaves_no_file_nor_temporary(tmp_path, monkeypatch):
    """A full disk in the middle of writing: one line, exit 2, no half file, no .NAME.* temporary."""
    import poet_opt.files as files_module

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files_module.json, "dump", full_disk)
    out = tmp_path / "deep" / "x.json"
    assert_one_line_error(cli(*solve_args("--out", out)), os.strerror(errno.ENOSPC), out=out)


def test_out_directories_are_created(tmp_path):
    out = tmp_path / "a" / "b" / "x.json"
    result = cli(*solve_args("-q", "--out", out))
    assert result.exit_code == 0, result.stderr
    assert json.loads(out.read_text())["format"] == "poet-opt/schedule@1"


# ---------------------------------------------------------------- validate


def _edited(good_doc, edit) -> dict:
    doc = json.loads(json.dumps(good_doc))
    edit(doc)
    return doc


@pytest.mark.parametrize("text, says", [
    ("not json{", "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('"a string"', "expected a JSON object"),
    ('{"format": "something/else@1"}', "format is 'something/else@1'"),
    ('{"steps": []}', "no 'format' field"),
])
def test_validate_not_a_schedule(tmp_path, text, says):
    path = tmp_path / "s.json"
    path.write_text(text)
    assert_one_line_error(cli("validate", path), "s.json", says)


def test_validate_not_utf8(tmp_path):
    path = tmp_path / "s.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line_error(cli("validate", path), "s.json", "UTF-8")


def test_validate_future_version(tmp_path, good_doc):
    path = write_doc(tmp_path / "v2.json", _edited(good_doc, lambda d: d.__setitem__("format", "poet-opt/schedule@2")))
    assert_one_line_error(cli("validate", path), "v2.json", "poet-opt/schedule@2", "poet-opt/schedule@1")


def test_validate_missing_file(tmp_path):
    assert_one_line_error(cli("validate", tmp_path / "none.json"), "none.json", "No such file")


@pytest.mark.parametrize("edit, says", [
    (lambda d: d["budgets"].__setitem__("ram_bytes", d["totals"]["peak_ram_bytes"] - 1), "exceeds the budget ram_bytes"),
    (lambda d: d.__setitem__("steps", d["steps"][1:]), "step 0"),
    (lambda d: d["totals"].__setitem__("energy_j", 2 * d["totals"]["energy_j"]), "totals.energy_j"),
    (lambda d: d["totals"].__setitem__("computes", d["totals"]["computes"] + 1), "totals.computes"),
    (lambda d: d["budgets"].__setitem__("runtime_s", d["totals"]["runtime_s"] / 2), "runtime"),
])
def test_validate_violation_exits_1_naming_the_first(tmp_path, good_doc, edit, says):
    path = write_doc(tmp_path / "bad.json", _edited(good_doc, edit))
    assert_one_line_error(cli("validate", path), "bad.json", says, code=1)


def test_validate_malformed_parts_exit_2(tmp_path, good_doc):
    path = write_doc(tmp_path / "bad.json", _edited(good_doc, lambda d: d["steps"].append({"op": "dance", "node": 0})))
    assert_one_line_error(cli("validate", path), "bad.json", "unknown op 'dance'", code=2)


def test_validate_deeply_nested_json_is_bad_input(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000)
    assert_one_line_error(cli("validate", path), "deep.json", code=2)


# ---------------------------------------------------------------- click's own usage errors


@pytest.mark.parametrize("args, needles", [
    (["solve", "--model", "mlp", "--ram", "1MB"], ["Missing option '--device'"]),
    (["solve", "--model", "mlp", "--device", "rpi4"], ["Missing option '--ram'"]),
    (["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--mode", "fast"],
     ["'--mode'", "'fast'", "joint", "remat", "paging"]),
    (["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--solver", "cplex"], ["'--solver'", "highs"]),
    (["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--batch-size", "0"], ["'--batch-size'"]),
    (["solve", "--model", "mlp", "--device", "rpi4", "--ram", "1MB", "--colour", "red"], ["--colour"]),
    (["validate"], ["Missing argument 'SCHEDULE_FILE'"]),
    (["frobnicate"], ["No such command 'frobnicate'"]),
])
def test_click_usage_errors_exit_2_naming_the_option(args, needles):
    assert_usage_error(cli(*args), *needles)


# ---------------------------------------------------------------- the safety net


def test_an_internal_error_is_one_line_exit_3(tmp_path, monkeypatch):
    import poet_opt.schedule.report as report

    def broken(schedule):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(report, "summary_text", broken)
    out = tmp_path / "x.json"
    assert_one_line_error(cli(*solve_args("--out", out)), "internal error", "ZeroDivisionError", "report",
                          code=3, out=out)


def test_interrupt_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    import poet_opt.solver.driver as solve_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(solve_module, "solve", interrupted)
    out = tmp_path / "x.json"
    assert_one_line_error(cli(*solve_args("--out", out)), "interrupted", code=130, out=out)


def test_graph_of_zero_cost_nodes_solves(tmp_path):
    nodes = [{**_node(0), "cost_cpu": 0}, {**_node(1, True), "cost_cpu": 0}]
    path = _graph(tmp_path, nodes, [{"source": 0, "target": 1}])
    result = cli("solve", "--graph", path, "--device", "rpi4", "--ram", "1MB", "-q", *FAST)
    assert result.exit_code == 0, result.stderr


def test_run_shares_solves_options_with_solves_defaults():
    """Without --schedule, `poet-opt run` solves the plan itself: each option it shares with `solve`
    has solve's default (and choices), and what it does not expose it leaves to the solver's
    defaults, which are solve's too. Else `run --costs` would follow another plan than
    `solve --costs` writes for the same arguments (docs/executor.md)."""
    import inspect

    pytest.importorskip("torch")
    from poet_opt.executor.train import run_training
    from poet_opt.solver.driver import solve as solve_schedule

    def options(command):
        return {p.opts[0] if p.opts[0].startswith("--") else p.opts[-1]: p for p in main.commands[command].params}

    solve, run = options("solve"), options("run")
    for name in ("--runtime", "--mode", "--time-limit", "--trainable", "--costs", "--device", "--ram"):
        assert name in run, f"run lacks solve's {name}"
    shared = sorted(set(solve) & set(run))
    for name in shared:
        if not (run[name].required or solve[name].required):  # a required option has no default to agree on
            assert run[name].default == solve[name].default, (name, run[name].default, solve[name].default)
        assert getattr(run[name].type, "choices", None) == getattr(solve[name].type, "choices", None), name
    # what run passes to the solver when the option is left at its default
    given = inspect.signature(run_training).parameters
    assert given["runtime"].default is None and given["time_limit"].default is None
    assert given["trainable"].default == solve["--trainable"].default
    assert given["mode"].default is None  # None: the solver's default, below
    solver = inspect.signature(solve_schedule).parameters
    for option, parameter in (("--mode", "mode"), ("--solver", "backend"), ("--order", "order"), ("--gap", "gap"),
                              ("--time-limit", "time_limit"), ("--runtime", "runtime")):
        assert solver[parameter].default == solve[option].default, (option, solver[parameter].default)
