"""A training step as a compact program of kernel calls, run by a small interpreter on the core.

The writers (writer.py, strip_codegen.py) emit a step as straight-line C: one kernel call per
statement, every argument a constant (an arena offset, a size, a float, a const table). That is
the clearest code for a small plan, but its size grows with the plan: ResNet-18 on the nRF52840 at
200 KiB is about 180,000 calls a step, a 16 MB C file that zig cc does not compile within minutes,
and whose code would not fit a 1 MB flash.

Here the same statements become data: each call is a kernel number and its arguments, encoded as
variable-length integers, and a generated interpreter (one ``case`` per kernel the step uses)
decodes and calls them in order. The program sits in flash as a const array when it is small, or
on the storage device beside the streamed weights (provisioned with them), read through a small
RAM buffer as it runs. Every argument keeps its exact value, so the kernels see what the
straight-line step would pass them, bit for bit (tests/test_step_program.py runs both).

An argument is one of: a pointer (a named array the step uses, plus a whole number of 4-byte
elements), a whole number, a float (an index into a table of the floats the step uses), or NULL.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from poet_opt.errors import PoetError
from poet_opt.firmware.c_text import identifier

# a step whose straight-line C would have more calls than this runs as a program
PROGRAM_CALLS = 20_000
# a program larger than this lies on the storage device, not in the image's flash
FLASH_PROGRAM_BYTES = 128 * 1024
# the RAM buffer a storage-resident program is read through, and the longest record it may hold
READ_BUFFER_BYTES = 512
MAX_RECORD_BYTES = 160
STORE_LOSS = "*loss"  # ``*loss = p[0];``: the step's one statement that is not a call
# what the caller of the train step passes in (library.py): a program in flash cannot name them as
# constants, so their slots in the bases and floats tables are filled as the program starts
RUNTIME_BASES = ("poet_input", "poet_labels")
RUNTIME_FLOATS = ("poet_lr",)
IDS_CAST = "(const int32_t *)"

_CALL = re.compile(r"^(rc = )?(poet_\w+)\((.*)\);$")
_LOSS = re.compile(r"^\*loss = (.+)\[0\];$")
_FLOAT = re.compile(r"^(?:-?0x[0-9a-f]+(?:\.[0-9a-f]*)?p[+-]?\d+f|0\.0f|\(-__builtin_inff\(\)\))$")
_SYMBOL = re.compile(r"^&?poet_\w+$")
_WHOLE = re.compile(r"^\d+u?$")


@dataclass(frozen=True)
class Arg:
    kind: str  # "ptr", "int", "float" or "null"
    base: str = ""  # ptr: the array (or &table) it points into
    value: int | float = 0  # ptr: offset in 4-byte elements; int: the number; float: the value


@dataclass(frozen=True)
class Call:
    kernel: str
    args: tuple[Arg, ...]
    checks_rc: bool = False  # ``rc = f(...); if (rc) return rc;``: a storage error ends the step


@dataclass
class StepProgram:
    calls: list[Call]
    kernels: list[str]  # kernel number -> name, in first use
    kinds: dict[str, tuple[str, ...]]  # kernel -> its arguments' kinds ("ptr", "int", "float")
    checked: set[str]  # kernels whose non-zero result (a storage error) ends the step
    bases: list[str]  # base number -> array name; 0 is NULL
    floats: list  # a float, or the name of one of RUNTIME_FLOATS
    code: bytes


def parse_step(lines: list[str]) -> list[Call]:
    """The calls of a straight-line step body, in order; PoetError names a statement no program
    can hold (the caller then keeps the straight-line step)."""
    calls: list[Call] = []
    k = 0
    while k < len(lines):
        line = lines[k].strip()
        k += 1
        if not line or line.startswith("/*"):
            continue
        loss = _LOSS.match(line)
        if loss:
            calls.append(Call(STORE_LOSS, (_arg(loss.group(1)),)))
            continue
        call = _CALL.match(line)
        if call is None:
            raise PoetError(f"internal: no step program holds the statement {line!r}")
        checks = bool(call.group(1))
        if checks:
            if k >= len(lines) or lines[k].strip() != "if (rc) return rc;":
                raise PoetError(f"internal: {line!r} sets rc without checking it")
            k += 1
        calls.append(Call(call.group(2), tuple(_arg(a) for a in _split(call.group(3))), checks))
    return calls


def _split(text: str) -> list[str]:
    """Top-level comma-separated arguments (parentheses nest)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [a.strip() for a in out if a.strip()]


def _arg(text: str) -> Arg:
    text = text.strip()
    if text == "NULL":
        return Arg("null")
    if text in RUNTIME_FLOATS:
        return Arg("float", base=text)
    if text.startswith(IDS_CAST):  # token ids in the arena (writer.ids): the interpreter passes a void *
        text = text[len(IDS_CAST):]
    if _FLOAT.match(text):
        return Arg("float", value=_float_value(text))
    base, offset = "", 0
    for term in _terms(text):
        if _WHOLE.match(term):
            offset += int(term.rstrip("u"))
        elif _SYMBOL.match(term) and not base:
            base = term
        else:
            raise PoetError(f"internal: no step program holds the argument {text!r}")
    return Arg("ptr", base, offset) if base else Arg("int", value=offset)


def _terms(text: str) -> list[str]:
    """``(poet_arena + 12u) + 3u`` -> [poet_arena, 12u, 3u]: sums of one array and whole numbers."""
    return [t.strip() for t in text.replace("(", " ").replace(")", " ").split("+") if t.strip()]


def _float_value(text: str) -> float:
    if text == "(-__builtin_inff())":
        return float("-inf")
    return float.fromhex(text.rstrip("f"))


def encode(calls: list[Call]) -> StepProgram:
    kernels: list[str] = []
    kernel_index: dict[str, int] = {}
    kinds: dict[str, tuple[str, ...]] = {}
    checked = {c.kernel for c in calls if c.checks_rc}
    if any(c.kernel in checked and not c.checks_rc for c in calls):
        raise PoetError("internal: a kernel's result is checked at some calls and not at others")
    bases: list[str] = ["NULL"]
    base_index: dict[str, int] = {}
    floats: list[float] = []
    float_index: dict[bytes, int] = {}
    code = bytearray()
    for call in calls:
        shape = tuple("ptr" if a.kind == "null" else a.kind for a in call.args)
        if call.kernel not in kinds:
            kinds[call.kernel] = shape
            kernel_index[call.kernel] = len(kernels)
            kernels.append(call.kernel)
        elif kinds[call.kernel] != shape:
            raise PoetError(f"internal: {call.kernel} is called with arguments of kinds {shape} and {kinds[call.kernel]}")
        code += _varint(kernel_index[call.kernel])
        for a in call.args:
            if a.kind == "null":
                code += _varint(0) + _varint(0)
            elif a.kind == "ptr":
                if a.base not in base_index:
                    base_index[a.base] = len(bases)
                    bases.append(a.base)
                code += _varint(base_index[a.base]) + _varint(int(a.value))
            elif a.kind == "int":
                code += _varint(int(a.value))
            else:  # by bits: -0.0 and 0.0 stay apart; a runtime float by its name
                bits = a.base.encode() if a.base else struct.pack("<f", a.value)
                if bits not in float_index:
                    float_index[bits] = len(floats)
                    floats.append(a.base or a.value)
                code += _varint(float_index[bits])
    return StepProgram(calls, kernels, kinds, checked, bases, floats, bytes(code))


def _varint(value: int) -> bytes:
    if value < 0 or value >= 1 << 32:
        raise PoetError(f"internal: {value} does not fit a step program's 32-bit argument")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def interpreter(program: StepProgram, *, storage_offset: int | None) -> list[str]:
    """C declarations and ``static int poet_run_program(float *loss)``: the program's bytes (a
    const array, or ``storage_offset`` on the storage device), the arrays and floats it names, and
    the decode-and-call loop."""
    lines = []
    if storage_offset is None:
        lines.append(_bytes_array("poet_program", program.code))
    runtime_bases = [k for k, b in enumerate(program.bases) if b in RUNTIME_BASES]
    runtime_floats = [k for k, f in enumerate(program.floats) if isinstance(f, str)]
    lines += [
        f"static void *{'' if runtime_bases else 'const '}poet_program_bases[] = {{",
        # a base is a generated array or the address of a generated struct (_SYMBOL's \w takes any
        # Unicode letter: only an ASCII identifier passes into C)
        *(f"    (void *){'0' if b in ('NULL', *RUNTIME_BASES) else b[:b.startswith('&')] + identifier(b.lstrip('&'))},"
          for b in program.bases),
        "};",
        # only a step with a float argument reads the table: an unused one fails -Werror
        *([f"static {'' if runtime_floats else 'const '}float poet_program_floats[{len(program.floats)}] = {{"
           + ", ".join("0.0f" if isinstance(f, str) else _c_float(f) for f in program.floats) + "};"]
          if program.floats else []),
        "",
        "typedef struct {",
        "    const uint8_t *at;  /* the next byte to decode */",
        "    const uint8_t *end; /* the end of what is buffered */",
        *(["    uint8_t buffer[POET_PROGRAM_BUFFER_BYTES];", "    uint32_t next_read; /* storage offset not yet read */"]
          if storage_offset is not None else []),
        "} poet_program_reader;",
        "",
        "static uint32_t poet_program_u32(poet_program_reader *r)",
        "{",
        "    uint32_t value = 0u, shift = 0u;",
        "    uint8_t byte;",
        "    do {",
        "        byte = *r->at++;",
        "        value |= (uint32_t)(byte & 0x7Fu) << shift;",
        "        shift += 7u;",
        "    } while (byte & 0x80u);",
        "    return value;",
        "}",
        "",
        "static void *poet_program_ptr(poet_program_reader *r)",
        "{",
        "    uint32_t base = poet_program_u32(r);",
        "    uint32_t words = poet_program_u32(r);",
        "    return base ? (void *)((uint8_t *)poet_program_bases[base] + 4u * words) : (void *)0;",
        "}",
        "",
    ]
    if storage_offset is not None:
        lines += [
            f"#define POET_PROGRAM_OFFSET {storage_offset}u",
            "",
            "/* Keeps a whole record buffered: what is left moves to the front, the rest is read. */",
            "static int poet_program_fill(poet_program_reader *r)",
            "{",
            "    uint32_t left = (uint32_t)(r->end - r->at), want, i;",
            f"    if (left >= {MAX_RECORD_BYTES}u || r->next_read >= POET_PROGRAM_OFFSET + POET_PROGRAM_BYTES) {{",
            "        return 0;",
            "    }",
            "    for (i = 0u; i < left; ++i) {",
            "        r->buffer[i] = r->at[i];",
            "    }",
            "    want = POET_PROGRAM_BUFFER_BYTES - left;",
            "    if (want > POET_PROGRAM_OFFSET + POET_PROGRAM_BYTES - r->next_read) {",
            "        want = POET_PROGRAM_OFFSET + POET_PROGRAM_BYTES - r->next_read;",
            "    }",
            "    if (poet_storage_read(r->next_read, r->buffer + left, want) != POET_STORAGE_OK) {",
            "        return -1;",
            "    }",
            "    r->next_read += want;",
            "    r->at = r->buffer;",
            "    r->end = r->buffer + left + want;",
            "    return 0;",
            "}",
            "",
        ]
    lines += [
        "static int poet_run_program(float *loss)",
        "{",
        "    int rc = 0;",
        "    poet_program_reader r;",
    ]
    if storage_offset is None:
        lines += ["    r.at = poet_program;", "    r.end = poet_program + POET_PROGRAM_BYTES;"]
    else:
        lines += ["    r.at = r.end = r.buffer;", "    r.next_read = POET_PROGRAM_OFFSET;"]
    lines += [f"    poet_program_bases[{k}] = (void *){identifier(program.bases[k])};" for k in runtime_bases]
    lines += [f"    poet_program_floats[{k}] = {identifier(program.floats[k])};" for k in runtime_floats]
    lines += ["    (void)loss;", "    for (;;) {"]
    if storage_offset is not None:
        lines += ["        if (poet_program_fill(&r)) {", "            return -4; /* POET_STORAGE_E_IO */", "        }"]
    lines += [
        "        if (r.at >= r.end) {",
        "            return rc;",
        "        }",
        "        switch (poet_program_u32(&r)) {",
    ]
    for number, kernel in enumerate(program.kernels):
        lines += _case(number, kernel, program.kinds[kernel], kernel in program.checked)
    lines += [
        "        default:",
        "            return -4; /* a corrupt program: stop rather than call anything */",
        "        }",
        "    }",
        "}",
        "",
    ]
    head = [f"#define POET_PROGRAM_BYTES {len(program.code)}u"]
    if storage_offset is not None:
        head += [f"#define POET_PROGRAM_BUFFER_BYTES {READ_BUFFER_BYTES}u", '#include "poet_storage.h"']
    return head + lines


def _case(number: int, kernel: str, kinds: tuple[str, ...], checked: bool) -> list[str]:
    decode = {"ptr": "poet_program_ptr(&r)", "int": "poet_program_u32(&r)",
              "float": "poet_program_floats[poet_program_u32(&r)]"}
    ctype = {"ptr": "void *", "int": "uint32_t ", "float": "float "}
    body = [f"        case {number}u: {{"]
    body += [f"            {ctype[kind]}a{k} = {decode[kind]};" for k, kind in enumerate(kinds)]
    if kernel == STORE_LOSS:
        body.append("            *loss = ((const float *)a0)[0];")
    else:
        args = ", ".join(f"a{k}" for k in range(len(kinds)))
        body.append(f"            {'rc = ' if checked else ''}{identifier(kernel)}({args});")
        if checked:
            body.append("            if (rc) {")
            body.append("                return rc;")
            body.append("            }")
    body += ["            break;", "        }"]
    return body


def _bytes_array(name: str, data: bytes) -> str:
    rows = ",\n".join("    " + ", ".join(f"0x{b:02x}u" for b in data[k:k + 16]) for k in range(0, len(data), 16))
    return f"static const uint8_t {name}[{max(1, len(data))}] = {{\n{rows or '    0u'}\n}};\n"


def _c_float(value: float) -> str:
    if value == float("-inf"):
        return "(-__builtin_inff())"
    return f"{value.hex()}f" if value else "0.0f"


def storage_offset(flash, capacity: int | None, nbytes: int) -> int:
    """Where a storage-resident program lies: after every region of the flash plan (weights and
    paged tensors), on an erase-block boundary so that no write to a region can touch it."""
    end = max((flash.offsets[n] + flash.region_bytes[n] for n in flash.offsets), default=0)
    block = max(1, int(flash.erase_block))
    at = -(-end // block) * block
    if capacity is not None and at + nbytes > capacity:
        raise PoetError(f"the step program ({nbytes:,} B) does not fit the storage beside the plan's regions "
                        f"({at:,} B of {capacity:,} B)", field="--device")
    return at
