"""Every command in README.md and docs/*.md runs as written, and what the docs show it print, it prints.

For each document, its fenced blocks are run in document order in one scratch directory that looks
like a checkout (`.venv`, `hardware_profiles/`, `poet_opt/`, `benchmarks/` linked in, `schedules/`
copied so that nothing writes into the repository):

- ```sh and ```console blocks: each command, continuation lines joined. `poet-opt ...` and
  `python ...` commands run; `pip install 'poet-opt[X]'` is not run (the suite's environment has
  its extras) but X must be an extra in pyproject.toml. Any other program (dd, dask, ...) must be
  tagged, so that a new kind of command is a decision, not an accident.
- In a ```console block, the lines after a `$ command` are an excerpt of its output: each must
  appear in what the command prints (stdout or stderr), in that order; `...` stands for lines left out.
- ```python blocks run as scripts.
- A ```text block of `poet-opt: error: ...` lines is a list of documented errors: each is
  reproduced (the profile faults from the document's own YAML profile) and must be printed exactly.

Tags (a comment on the command, or on the first line of a python block) say what is not run here:
`# long ...` (minutes: run by `benchmarks/docs_check.py`), `# cluster ...` (needs a Dask cluster;
docs_check.py starts one), `# on the board ...` (measurements on the target device), `# interactive
...` (opens a user interface). An untagged command that takes more than a minute fails, asking for
the tag. The whole file takes about half a minute on two cores (the documents run two at a time).

Files the documents use without making them are made from the documents' own blocks (FIXTURES):
the graph of docs/graphs.md is `my_graph.json`, the profile of docs/profiles.md is `my-board.yaml`,
and so on. Documents with their own test are skipped (OWN_TEST); any new document is included."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# documents whose commands another test runs: name -> that test
OWN_TEST = {
    "docs/firmware.md": "tests/test_firmware_training.py::test_the_commands_in_docs_firmware_md_run",
    "docs/executor.md": "tests/test_executor.py::test_the_commands_in_docs_executor_md_run",
}

TAGS = ("long", "cluster", "on the board", "interactive")
SLOW_S = 60.0  # an untagged command slower than this must be tagged `# long`


@dataclass
class Block:
    lang: str
    body: str
    line: int


@dataclass
class Command:
    text: str  # without the comment
    comment: str
    expected: list[str] = field(default_factory=list)  # console blocks: the output excerpt

    @property
    def tag(self) -> str | None:
        c = self.comment.strip().lower()
        return next((t for t in TAGS if c.startswith(t)), None)


def documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in docs if p.relative_to(ROOT).as_posix() not in OWN_TEST]


FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        body = "\n".join(line[indent:] for line in m.group("body").splitlines())
        found.append(Block(m.group("lang"), body, text[: m.start()].count("\n") + 1))
    if path.name == "README.md":  # its first block (install and solve; install and test): tests/test_readme.py
        first_sh = next(i for i, b in enumerate(found) if b.lang == "sh")
        del found[first_sh]
    return found


def split_comment(line: str) -> tuple[str, str]:
    """'cmd "a # b" # note' -> ('cmd "a # b"', 'note'): a # outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def commands(block: Block) -> list[Command]:
    """The commands of a sh or console block, continuation lines joined (their comments too)."""
    out: list[Command] = []
    pending: list[str] = []
    notes: list[str] = []
    console = block.lang == "console"
    for raw in block.body.splitlines():
        if console and not pending and not raw.startswith("$ "):
            if out and raw.strip():
                out[-1].expected.append(raw.strip())
            continue
        line = raw[2:] if console and not pending else raw
        code, note = split_comment(line)
        if note:
            notes.append(note)
        if code.endswith("\\"):
            pending.append(code[:-1].strip())
            continue
        pending.append(code.strip())
        text = " ".join(p for p in pending if p)
        if text:
            out.append(Command(text, "; ".join(notes)))
        pending, notes = [], []
    return out


# ------------------------------------------------------------------ the scratch checkout and fixtures


def block_of(doc: str, lang: str, containing: str = "") -> str:
    for b in blocks(ROOT / doc):
        if b.lang == lang and containing in b.body:
            return b.body
    raise AssertionError(f"{doc} has no {lang} block containing {containing!r} (a fixture reads it)")


def _run_python_block(doc, containing):
    def make(cwd: Path, name: str) -> None:
        pytest.importorskip("torch")
        pytest.importorskip("onnx")
        run = subprocess.run([sys.executable, "-c", block_of(doc, "python", containing)], cwd=cwd,
                             capture_output=True, text=True, timeout=300, env=environment(cwd))
        assert run.returncode == 0, run.stderr
        assert (cwd / name).exists(), f"{doc}'s python block does not write {name}"
    return make


def _write_block(doc, lang, containing=""):
    def make(cwd: Path, name: str) -> None:
        (cwd / name).write_text(block_of(doc, lang, containing) + "\n")
    return make


# files the documents use without creating them, made from the documents' own blocks
FIXTURES = {
    "my_graph.json": _write_block("docs/graphs.md", "json"),  # the graph format's example
    "my-board.yaml": _write_block("docs/profiles.md", "yaml", "storage:"),  # the profile it explains
    "my_board.csv": _write_block("docs/importers.md", "csv"),  # the measured-costs example
    "model.onnx": _run_python_block("docs/importers.md", "model.onnx"),  # its export example
}


def environment(cwd: Path) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{cwd / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["MPLBACKEND"] = "Agg"
    env.pop("POET_OPT_DEBUG", None)
    return env


def scratch_checkout(tmp: Path) -> Path:
    venv = Path(sys.prefix)  # the environment running the suite: its bin/ has poet-opt and python
    (tmp / ".venv").symlink_to(venv, target_is_directory=True)
    for name in ("hardware_profiles", "poet_opt", "benchmarks", "notebooks"):
        (tmp / name).symlink_to(ROOT / name, target_is_directory=True)
    # copied: regenerate.py writes next to itself
    (tmp / "schedules").mkdir()
    shutil.copy2(ROOT / "schedules" / "regenerate.py", tmp / "schedules")
    shutil.copytree(ROOT / "schedules" / "examples", tmp / "schedules" / "examples")
    return tmp


def make_fixtures(argv: list[str], cwd: Path, done: set) -> None:
    for arg in argv:
        name = arg.removeprefix("./")
        if name in FIXTURES and name not in done and not (cwd / name).exists():
            FIXTURES[name](cwd, name)
            done.add(name)


# ------------------------------------------------------------------ running and checking


def extras() -> set[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def run(argv: list[str] | str, cwd: Path, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=environment(cwd),
                            shell=isinstance(argv, str))
    return result, time.monotonic() - start


def check_excerpt(expected: list[str], printed: str, where: str) -> None:
    """Each expected line (whitespace runs collapsed) is a line of the output, in order; '...' skips."""
    norm = [" ".join(line.split()) for line in printed.splitlines()]
    k = 0
    for want in expected:
        if want == "...":
            continue
        want = " ".join(want.split())
        while k < len(norm) and norm[k] != want:
            k += 1
        assert k < len(norm), f"{where}: the docs show the line\n  {want}\nwhich the command does not print:\n{printed}"
        k += 1


def run_command(cmd: Command, cwd: Path, done: set, where: str, slow_s: float = SLOW_S,
                timeout: float = 600) -> str:
    """Runs one command; returns what it was (for the report of what ran)."""
    argv = shlex.split(cmd.text)
    if argv[0].removeprefix(".venv/bin/") == "pip" and argv[1:2] == ["install"]:
        for spec in argv[2:]:
            m = re.fullmatch(r"(?:poet-opt|\.|-e)\[([\w,-]+)\]", spec)
            if m:
                missing = set(m.group(1).split(",")) - extras()
                assert not missing, f"{where}: `{cmd.text}` names extras pyproject.toml lacks: {missing}"
        return "checked extras"
    if cmd.tag:
        return f"skipped ({cmd.tag})"
    program = argv[0].removeprefix(".venv/bin/")
    assert program in ("poet-opt", "python", "python3"), (
        f"{where}: `{cmd.text}`: not a poet-opt or python command; run it here, or tag it with a comment "
        f"starting with one of {TAGS}")
    make_fixtures(argv, cwd, done)
    result, seconds = run(cmd.text, cwd, timeout)
    printed = result.stdout + result.stderr
    assert result.returncode == 0, f"{where}: `{cmd.text}` exited {result.returncode}:\n{printed}"
    assert seconds < slow_s, f"{where}: `{cmd.text}` took {seconds:.0f} s: tag it `# long` (docs_check.py runs it)"
    if cmd.expected:
        check_excerpt(cmd.expected, printed, where)
    return f"ran in {seconds:.1f} s"


ERROR = re.compile(r"poet-opt: error: (?P<where>[^:]+): (?P<rest>.*)")


def reproduce_error(line: str, doc: Path, cwd: Path, where: str) -> None:
    """Makes the program print a documented error line: an unknown device by naming it; a profile
    fault (`FILE.yaml: a.b: message`) by applying it to the document's own YAML profile: `(got V)`
    sets the field to V, `missing field` deletes it, `unknown field` adds it."""
    m = ERROR.fullmatch(line.strip())
    assert m, f"{where}: not an error line: {line}"
    expected = line.strip()
    device = re.match(r"unknown device '([^']+)'", m.group("rest"))
    if m.group("where") == "--device" and device:
        device_arg = device.group(1)
    elif m.group("where").endswith(".yaml"):
        field, message = m.group("rest").split(": ", 1)
        profile = yaml.safe_load(block_of(doc.relative_to(ROOT).as_posix(), "yaml", "storage:"))
        *parents, leaf = field.split(".")
        node = profile
        for key in parents:
            node = node[key]
        if got := re.search(r"\(got (.*)\)$", message):
            node[leaf] = yaml.safe_load(got.group(1))
        elif message.startswith("missing field"):
            del node[leaf]
        elif message.startswith("unknown field"):
            node[leaf] = 1
        else:
            raise AssertionError(f"{where}: no rule to reproduce {line!r}: extend reproduce_error")
        target = cwd / Path(m.group("where")).name
        target.write_text(yaml.safe_dump(profile))
        device_arg = str(target)
        expected = expected.replace(m.group("where"), str(target), 1)
    else:
        raise AssertionError(f"{where}: no rule to reproduce {line!r}: extend reproduce_error")
    result, _ = run(["poet-opt", "solve", "--model", "mlp", "--device", device_arg, "--ram", "64KiB"], cwd)
    assert result.returncode == 2, (where, result.returncode, result.stderr)
    assert result.stderr.strip() == expected, f"{where}: the docs show\n  {expected}\nthe program prints\n  {result.stderr}"


def run_document(doc: Path, tmp_path: Path) -> list[str]:
    """Runs a document's blocks in order; returns what ran, raises at the first disagreement."""
    cwd = scratch_checkout(tmp_path)
    done: set = set()
    report = []
    for block in blocks(doc):
        where = f"{doc.relative_to(ROOT)}:{block.line}"
        if block.lang in ("sh", "console"):
            for cmd in commands(block):
                report.append(f"{where}: {cmd.text[:70]}: {run_command(cmd, cwd, done, where)}")
        elif block.lang == "python":
            first = block.body.lstrip().splitlines()[0]
            tag = Command("", split_comment(first)[1] if first.startswith("#") else "").tag
            if tag:
                report.append(f"{where}: python block skipped ({tag})")
                continue
            if "model.onnx" in done and "model.onnx" in block.body:
                continue  # this block already ran, to make the fixture
            if "import torch" in block.body:
                pytest.importorskip("torch")
            (cwd / "block.py").write_text(block.body + "\n")
            result, seconds = run([sys.executable, "block.py"], cwd)
            assert result.returncode == 0, f"{where}: the python block fails:\n{result.stderr}"
            report.append(f"{where}: python block ran in {seconds:.1f} s")
        elif block.lang == "text" and block.body.lstrip().startswith("poet-opt: error:"):
            for line in block.body.splitlines():
                if line.strip():
                    reproduce_error(line, doc, cwd, where)
            report.append(f"{where}: {len(block.body.splitlines())} documented errors reproduced")
    return report


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """Every document run at once, two at a time (each is a sequence of subprocesses, mostly waiting
    on a solver: two in parallel halve the wall time on CI's two cores). doc -> (report, exception)."""
    def one(doc):
        try:
            return run_document(doc, tmp_path_factory.mktemp(doc.stem)), None
        except BaseException as exc:  # pytest's skip and fail too: re-raised in the document's test
            return [], exc
    docs = documents()
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(docs, pool.map(one, docs)))


# the first document's test waits for all of them (the fixture): about 30 s on two idle cores, but
# minutes on a loaded machine, past the suite's default five-minute limit
@pytest.mark.timeout(900)
@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_commands_in_the_docs_run_as_written(doc, outcomes):
    report, exc = outcomes[doc]
    print("\n".join(report))
    if exc is not None:
        raise exc


def test_every_document_is_either_run_here_or_has_its_own_test():
    docs = {p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}
    tested = {p.relative_to(ROOT).as_posix() for p in documents()}
    assert docs - tested == set(OWN_TEST)
    for doc, test in OWN_TEST.items():
        file, _, name = test.partition("::")
        assert f"def {name}(" in (ROOT / file).read_text(), f"{doc}: its own test {test} is gone"


def test_the_block_reader_on_a_made_up_document(tmp_path):
    """The parser itself: continuations, comments, tags, console output excerpts."""
    block = Block("console", "$ poet-opt a \\\n    --b 1   # long: minutes\nline one\n\n$ poet-opt c '#x' # note\n", 1)
    cmds = commands(block)
    assert [c.text for c in cmds] == ["poet-opt a --b 1", "poet-opt c '#x'"]
    assert cmds[0].tag == "long" and cmds[0].expected == ["line one"] and cmds[1].tag is None
    check_excerpt(["b", "...", "d"], "a\nb\nc\nd\n", "made up")
    with pytest.raises(AssertionError, match="does not print"):
        check_excerpt(["d", "b"], "a\nb\nc\nd\n", "made up")  # out of order
