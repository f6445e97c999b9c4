"""Names in generated C (issue 28: 1, 12, 13): whatever a torch module, a node-link graph or a
device profile calls things, the header and the training firmware compile warning-free under
strict C99 to the same symbols and train to the same losses, the names only ever inside escaped
comments and string literals (poet_opt/firmware/c_text.py)."""

from __future__ import annotations

import json
import keyword
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from poet_opt.cli import main

ZIG = [sys.executable, "-m", "ziglang", "cc"]
STRICT_C = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"]
# C99 5.2.4.1: the longest string literal a compiler must accept; -pedantic warns past it
MAX_STRING_BYTES = 4095

# Every way C text can be ended, spliced, redefined or disguised: comments, line splices, the
# preprocessor's tokens, trigraphs, digraphs, universal character names, line ends, bidi controls
C_TOKENS = ["/*", "*/", "//", "*", "/", "#", "##", "#define", "#include <x.h>", "#pragma once", "#if 0", "#endif",
            "#undef", "_Pragma(\"x\")", "__LINE__", "??=", "??/", "??'", "??(", "??)", "??!", "??<", "??>", "??-",
            "?", "??", "%:", "%:%:", "<:", ":>", "<%", "%>", "\\", "\\\n", "\\\r\n", "\n", "\r\n", "\r", "\x00",
            "\t", "\x0b", "\x0c", "\x85", "\u2028", "\u2029", "\u202e", "\u2066", "\ufeff", '"', "'", "\\x41",
            "\\u0041", "\\U00000041", "\\101", "0x1p+1f", "};", "{", "poet_arena", "POET_STEPS", "\U0001F600"]
ANY_CHAR = st.characters(codec=None, blacklist_categories=())  # every code point, surrogates too


def c_names(chars=ANY_CHAR):
    """Names built from C's dangerous tokens and any Unicode characters, side by side."""
    piece = st.one_of(st.sampled_from(C_TOKENS), st.text(chars, max_size=6))
    return st.lists(piece, min_size=1, max_size=6).map("".join).filter(lambda s: s != "")


def run(cmd, **kwargs):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-3000:]
    return done


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def symbols(path: Path) -> list[tuple]:
    """Every named symbol of an object or image with its kind, binding, section and size."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        table = elf.get_section_by_name(".symtab")
        return sorted((s.name, s["st_info"]["type"], s["st_info"]["bind"], str(s["st_shndx"]), s["st_size"],
                       s["st_value"]) for s in table.iter_symbols() if s.name)


# ---------------------------------------------------------------- c_text on its own


@settings(max_examples=300, deadline=None)
@given(st.lists(c_names(), min_size=1, max_size=3))
def test_escaped_comment_text_cannot_end_or_splice_a_comment(parts):
    from poet_opt.firmware.c_text import comment

    text = "/*" + "".join(comment(p) for p in parts) + "*/"
    body = text[2:-2]
    assert all(" " <= ch <= "~" for ch in text)  # one line, printable ASCII: nothing hidden, no line end
    assert "*/" not in body and "/*" not in body and "??" not in text
    assert not body.endswith("*") and not body.startswith("/")


def test_a_newline_in_a_comment_is_written_x0a_as_the_docs_say():
    from poet_opt.firmware.c_text import comment

    assert comment("a\nb\r\nc\td") == "a\\x0ab\\x0d\\x0ac\\x09d"
    assert comment("x*/y/*z??/w\\") == "x*\\x2fy\\x2f*z\\x3f\\x3f/w\\x5c"
    assert comment("\u202e\x00\U0001F600") == "\\u202e\\x00\\U0001f600"


def test_truncated_keeps_whole_characters_within_the_c99_limit():
    from poet_opt.firmware.c_text import TRUNCATION_MARK, string_literal, truncated

    assert truncated("a" * MAX_STRING_BYTES) == "a" * MAX_STRING_BYTES
    cut = truncated("€" * 2000)  # 3 bytes each: the cut falls inside a character unless it is careful
    assert cut.endswith(TRUNCATION_MARK) and set(cut[:-3]) == {"€"}
    assert len(cut.encode()) <= MAX_STRING_BYTES < len(cut.encode()) + 3
    assert len(string_literal("b" * 10_000)) == len(TRUNCATION_MARK) + MAX_STRING_BYTES - 1


def test_identifiers_are_never_made_of_names():
    from poet_opt.firmware import c_text

    assert c_text.identifier("poet", "gweight", 3) == "poet_gweight_3"
    for bad in ("x*/", "a b", "", "1a", "é"):
        with pytest.raises(AssertionError):
            c_text.identifier("poet", bad, 0)
    assert c_text.constant("0xFFu") == "0xFFu" and c_text.constant(16) == "16"
    with pytest.raises(AssertionError):
        c_text.constant("1); evil(")


# ---------------------------------------------------------------- the header (export)


def chain_graph(names: list[str], graph_name: str = "chain") -> dict:
    """Node-link: three forward nodes, a loss, three gradients; costs that make plain training fit."""
    nodes = [{"id": k, "name": names[k], "backward": k >= 4, "cost_cpu": 0.01, "cost_ram": 4096 + 64 * k}
             for k in range(7)]
    links = [(0, 1), (1, 2), (2, 3), (3, 4), (2, 4), (4, 5), (1, 5), (5, 6), (0, 6)]
    return {"directed": True, "multigraph": False, "graph": {"name": graph_name}, "nodes": nodes,
            "links": [{"source": a, "target": b} for a, b in links]}


def as_stored(name: str) -> str:
    """What POET_NODE_NAMES holds for a name (docs/c-export.md): past 4,095 bytes of UTF-8, the
    whole characters that fit with "..." after them; read as a C string, up to its first NUL."""
    if len(name.encode("utf-8", "surrogatepass")) > MAX_STRING_BYTES:
        kept, size = [], 0
        for ch in name:
            size += len(ch.encode("utf-8", "surrogatepass"))
            if size > MAX_STRING_BYTES - 3:
                break
            kept.append(ch)
        name = "".join(kept) + "..."
    return name.split("\x00")[0]


PLAIN_NAMES = ["f0", "f1", "f2", "loss", "g2", "g1", "g0"]

NAMES_PROGRAM = r"""#include "plan.h"
#include <stdio.h>
int main(void) {
    unsigned k, total = 0;
    for (k = 0; k < POET_NUM_STEPS; k++) total += POET_STEPS[k].bytes + POET_STEPS[k].node;
    for (k = 0; k < POET_NUM_OPERANDS; k++) total += POET_OPERANDS[k] + POET_OPERAND_NODES[k];
    printf("%u\n", total);
#ifdef POET_WITH_NAMES
    {
        const char *p;
        for (k = 0; k < POET_NUM_TENSORS; k++) {
            for (p = POET_NODE_NAMES[k]; *p; p++) printf("%02x", (unsigned)(unsigned char)*p);
            printf("\n");
        }
    }
#endif
    return 0;
}
"""


@pytest.fixture(scope="module")
def plain_export(tmp_path_factory):
    """The chain solved once with plain names, exported and compiled: what every renamed one must match."""
    pytest.importorskip("ziglang")
    work = tmp_path_factory.mktemp("plain")
    graph = work / "g.json"
    graph.write_text(json.dumps(chain_graph(PLAIN_NAMES)))
    out = work / "s.json"
    result = cli("solve", "--graph", graph, "--device", "rpi4", "--ram", "1MB", "-q", "--time-limit", "20", "--out", out)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(out.read_text())
    return doc, compile_header(work, export_header(work, doc))


def export_header(work: Path, doc: dict) -> Path:
    schedule, header = work / "s.json", work / "plan.h"
    schedule.write_text(json.dumps(doc))  # lone surrogates as \ud800 escapes, as any JSON may hold them
    result = cli("export", schedule, "-o", header)
    assert result.exit_code == 0, result.stderr
    return header


def compile_header(work: Path, header: Path) -> tuple[list, list[str]]:
    """Strict C99 without the names (an object: its symbols) and with them (run: the names as the
    C strings hold them)."""
    (work / "main.c").write_text(NAMES_PROGRAM)
    # relative paths: zig's default UBSan checks keep the source path in the object
    run([*ZIG, *STRICT_C, "-Woverlength-strings", "-I.", "main.c", "-c", "-o", "main.o"], cwd=work)
    run([*ZIG, *STRICT_C, "-Woverlength-strings", "-DPOET_WITH_NAMES", "-I.", "main.c", "-o", "main"], cwd=work)
    printed = run([work / "main"]).stdout.splitlines()
    names = [bytes.fromhex(line).decode("utf-8", "surrogatepass") for line in printed[1:]]
    return symbols(work / "main.o"), [printed[0], *names]


def renamed(doc: dict, names: list[str], graph_name: str, device_name: str) -> dict:
    doc = json.loads(json.dumps(doc))
    for node in doc["graph"]["nodes"]:  # node id is node given_ids[id] of the graph as given
        node["name"] = names[doc["graph"]["given_ids"][node["id"]]]
    doc["graph"]["name"] = doc["model"] = graph_name
    doc["device"]["name"] = doc["device"]["cpu"] = doc["device"]["source"] = device_name
    return doc


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(names=st.lists(c_names(), min_size=7, max_size=7, unique=True), graph_name=c_names(), device_name=c_names())
def test_any_names_export_a_header_that_compiles_strictly_to_the_same_symbols(tmp_path_factory, plain_export,
                                                                                names, graph_name, device_name):
    from poet_opt.model.load import load_training_graph

    doc, (plain_symbols, plain_printed) = plain_export
    work = tmp_path_factory.mktemp("named")
    graph_file = work / "g.json"
    graph_file.write_text(json.dumps(chain_graph(names, graph_name)))
    graph, _ = load_training_graph(graph_file=str(graph_file))  # the names as the node-link reader gives them
    assert sorted(n.name for n in graph.nodes) == sorted(names)
    header = export_header(work, renamed(doc, names, graph_name, device_name))
    got_symbols, printed = compile_header(work, header)
    assert got_symbols == plain_symbols
    assert printed[0] == plain_printed[0]  # the tables the program walks
    shown = [names[i] for i in doc["graph"]["given_ids"]]
    assert printed[1:] == [as_stored(n) for n in shown]


def test_names_past_4095_bytes_keep_the_header_warning_free(tmp_path, plain_export):
    """-Woverlength-strings (in -pedantic): a name of 4,096 bytes or more broke the build with
    POET_WITH_NAMES; it is now cut to whole characters and `...` within 4,095 bytes."""
    doc, _ = plain_export
    names = ["a" * MAX_STRING_BYTES, "b" * (MAX_STRING_BYTES + 1), "€" * 3000, "x" * 70_000, "*/\n" * 2000,
             "f2", "g"]
    header = export_header(tmp_path, renamed(doc, names, "long", "board"))
    _, printed = compile_header(tmp_path, header)
    shown = [names[i] for i in doc["graph"]["given_ids"]]
    assert printed[1:] == [as_stored(n) for n in shown]
    assert printed[1 + shown.index(names[0])] == names[0]  # at the limit: whole
    assert all(len(p.encode()) <= MAX_STRING_BYTES for p in printed[1:])


def test_header_comment_writes_a_newline_as_x0a(plain_export):
    from poet_opt.firmware.header import export

    doc, _ = plain_export
    header, _, _ = export(renamed(doc, PLAIN_NAMES, "two\nlines", "board\r\n"))
    assert "two\\x0alines" in header and "board\\x0d\\x0a" in header


# ---------------------------------------------------------------- the training firmware (emulate)


MODEL = """
import torch
from torch import nn

OUTER, INNER = {outer!r}, {inner!r}


class Net(nn.Module):
    # two layers whose module paths (and so parameter names) are the given strings
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({{OUTER: nn.ModuleDict({{INNER: nn.Linear(16, 8)}}), INNER: nn.Linear(8, 4)}})

    def forward(self, x):
        x = torch.relu(self.layers[OUTER][INNER](x))
        return self.layers[INNER](x)


def make():
    return Net()
"""


def batch(path: Path) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.standard_normal((2, 16)).astype(np.float32), y=np.array([1, 3]))
    return path


def emulate(work: Path, outer: str, inner: str, *extra):
    (work / "named_model.py").write_text(MODEL.format(outer=outer, inner=inner), encoding="utf-8")
    result = cli("emulate", "--torch", f"{work / 'named_model.py'}:make", "--input-shape", "2,16", "--device",
                 "stm32f746", "--ram", "16KiB", "--steps", "2", "--lr", "0.05", "--data", batch(work / "batch.npz"),
                 "-o", work / "out", "--json", "-q", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), work / "out"


@pytest.fixture(scope="module")
def plain_firmware(tmp_path_factory):
    pytest.importorskip("ziglang")
    pytest.importorskip("unicorn")
    pytest.importorskip("torch")
    summary, out = emulate(tmp_path_factory.mktemp("plain_fw"), "a", "ok")
    return summary, symbols(out / "poet_train.elf"), without_comments(out / "poet_train.c")


def without_comments(source: Path) -> str:
    """The C as the compiler sees it once comments are gone (translation phase 3: each is a space)."""
    return re.sub(r"/\*.*?\*/", " ", source.read_text(), flags=re.S)


def test_a_layer_name_cannot_inject_c_into_the_firmware(tmp_path, plain_firmware):
    """Issue 28, 1: the name ended the comment it was written into and redefined the ReLU kernel,
    so the firmware trained another network (other losses, other code)."""
    evil = "x*/ #define poet_relu_forward(o, i, n) poet_zero((o), (n)) /*"
    summary, out = emulate(tmp_path, evil, "ok")
    assert summary["loss"] == plain_firmware[0]["loss"]
    assert symbols(out / "poet_train.elf") == plain_firmware[1]
    assert without_comments(out / "poet_train.c") == plain_firmware[2]
    assert "x*\\x2f #define" in (out / "poet_train.c").read_text()  # the name is still there to read


def torch_can_trace(name: str) -> bool:
    """torch refuses "." in a module name, and torch.fx cannot trace a module path holding a quote,
    a backslash, a line end, a NUL, a lone surrogate or a Python keyword (issue 28, 5: another
    change makes those a one-line refusal); every other name must reach C harmlessly."""
    from torch import nn

    if keyword.iskeyword(name) or any(c in name for c in '."\\\n\r\x00') or any(0xD800 <= ord(c) < 0xE000
                                                                                for c in name):
        return False
    try:
        nn.ModuleDict({name: nn.Identity()})  # nor a name nn.Module already has as an attribute
    except (KeyError, TypeError):
        return False
    return True


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(outer=c_names().filter(torch_can_trace), inner=c_names().filter(torch_can_trace))
# found by this test: the writer took "layers./*.@"'s gradient for a partial sum of "layers./*."
@example(outer="/*", inner="@")
@example(outer="x", inner="x@1")
def test_any_torch_names_train_the_same_firmware(tmp_path_factory, plain_firmware, outer, inner):
    if outer == inner:
        inner += "_"
    summary, out = emulate(tmp_path_factory.mktemp("named_fw"), outer, inner)
    assert summary["loss"] == plain_firmware[0]["loss"]  # the build is -std=c99 -Wall -Wextra -Werror -pedantic
    assert symbols(out / "poet_train.elf") == plain_firmware[1]
    assert without_comments(out / "poet_train.c") == plain_firmware[2]


CLASHING = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 8)
        self.add_module("grad:relu", nn.Linear(8, 4))  # the name of the relu's gradient node

    def forward(self, x):
        return getattr(self, "grad:relu")(torch.relu(self.first(x)))


def make():
    return Net()
"""


def test_a_module_named_like_a_derived_node_is_refused(tmp_path, plain_firmware):
    """The generator finds operands by node name: a second node of the same name would be read as
    the first. One line naming --torch, exit 2, rather than a firmware that trains something else."""
    (tmp_path / "clash.py").write_text(CLASHING)
    result = cli("emulate", "--torch", f"{tmp_path / 'clash.py'}:make", "--input-shape", "2,16", "--device",
                 "stm32f746", "--ram", "16KiB", "--steps", "2", "--lr", "0.05", "--data", batch(tmp_path / "b.npz"),
                 "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.stderr
    line, = result.stderr.splitlines()
    assert "--torch" in line and "'grad:relu'" in line and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
