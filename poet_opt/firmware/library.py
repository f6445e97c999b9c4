"""The generated training step as a library an application links: ``<prefix>train.c`` and its
header ``<prefix>train.h``, plus the example ``main()`` the emulator runs (``poet_harness.c``).

An application owns ``main()``, its data and its learning rate, so none of them is compiled into
the library: ``<prefix>train_step`` takes the batch, its labels and the rate from the caller, and
``<prefix>predict`` runs the schedule's forward part (its steps up to the first compute of the
logits) in the same arena, in PyTorch's eval mode: batch norm normalises with its running
statistics, so a sample's logits do not depend on the rest of its batch. ``<prefix>save_weights`` / ``<prefix>load_weights`` keep what training
changed (the resident trainable weights and the norms' running statistics) in a storage area after
every region of the plan, so training survives a reset; streamed weights already live on storage
and are rewritten by every step.

Every name with external linkage carries the prefix, so two models link into one image; the
step's own arrays keep their ``poet_`` names with internal linkage. The arena is aligned to the
plan's alignment and placed in a section of its own (``.<prefix>arena``), which the linker script
puts in RAM (build.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from poet_opt import __version__
from poet_opt.errors import PoetError
from poet_opt.firmware.c_text import check_prefix, comment, float_literal, identifier
from poet_opt.firmware.writer import MARK_FUNCTION, GeneratedStep, StepWriter, c_array

HARNESS_FILE = "poet_harness.c"
HARNESS_LOSSES = "harness_losses"  # what the emulator reads back: one loss per step
# the saved-weights area's header: "POET" then a hash of the layout, so that a board never loads
# the weights of another model
SAVED_MAGIC = 0x54454F50
HEADER_BYTES = 16
SAVE_UNIT = 512  # a piece of the saved weights starts on a block of an SD card
# statuses: storage failures pass through as poet_storage.h's negative codes
STATUSES = [
    ("OK", 0, "success"),
    ("E_STORAGE_RANGE", -1, "storage: offset or length outside the device (POET_STORAGE_E_RANGE)"),
    ("E_STORAGE_ALIGN", -2, "storage: a write not in whole aligned blocks (POET_STORAGE_E_ALIGN)"),
    ("E_STORAGE_NOT_ERASED", -3, "storage: a program of an unerased flash block (POET_STORAGE_E_NOT_ERASED)"),
    ("E_STORAGE_IO", -4, "storage: the device or its driver failed (POET_STORAGE_E_IO)"),
    ("E_NOT_INITIALIZED", -16, "init was not called first"),
    ("E_ARGUMENT", -17, "a NULL pointer, or a learning rate that is not positive and finite"),
    ("E_LABEL", -18, "a label outside 0 .. CLASSES-1"),
    ("E_NO_SAVED_WEIGHTS", -19, "the storage holds no weights this model saved"),
    ("E_UNSUPPORTED", -20, "predict: the forward part is too long to generate as straight-line C"),
    ("E_TOKEN", -21, "a token id outside 0 .. VOCABULARY-1 (a model whose input is token ids)"),
]
API = ("init", "train_step", "predict", "save_weights", "load_weights", "status")


def schedule_sha256(doc: dict) -> str:
    """The hash of the schedule file ``poet-opt solve -o`` writes for ``doc`` (files.write_json_atomic)."""
    return hashlib.sha256((json.dumps(doc, indent=1) + "\n").encode()).hexdigest()


def check_library_prefix(prefix: str) -> None:
    """A prefix whose API names would clash with a name of the kernels, the paging or the storage
    interface would not link (or would silently call the wrong function); refuse it here."""
    check_prefix(prefix)
    names = set()
    here = Path(__file__).resolve().parent
    for header in (here / "kernels" / "poet_kernels.h", here / "board" / "poet_paging.h",
                   here / "board" / "poet_storage.h"):
        names.update(re.findall(r"\b[A-Za-z_]\w*\b", Path(header).read_text()))
    macros = [s for s, _, _ in STATUSES] + ["TRAIN_H", "BATCH", "INPUT_FLOATS", "INPUT_IDS", "VOCABULARY",
                                            "CLASSES", "LOGITS_FLOATS"]
    ours = [prefix + n for n in API] + [prefix.upper() + m for m in macros]
    clash = [n for n in ours if n in names]
    if clash:
        raise PoetError(f"{prefix!r} makes {clash[0]}, a name of the firmware's own library; choose another prefix",
                        field="--prefix")


def input_c_type(prefix: str, vocabulary: int | None) -> tuple[str, str]:
    """(the C type of a batch's inputs, the macro of their count) in ``<prefix>train.h``: float
    features, or int32 token ids when the model's input goes into embeddings."""
    return ("float", f"{prefix.upper()}INPUT_FLOATS") if vocabulary is None else \
        ("int32_t", f"{prefix.upper()}INPUT_IDS")


def running_statistics(emulator, network) -> dict[str, np.ndarray]:
    """The norms' running statistics an emulated run left in RAM, under the names torch's
    ``named_buffers()`` gives them, so that ``load_state_dict`` takes them beside the weights and
    the module's ``eval()`` predicts as the firmware's predict does."""
    return {b.torch_name: emulator.read_symbol(identifier("poet", role, k), np.float32)[:b.value.size]
            .reshape(b.value.shape).copy()
            for k, layer in enumerate(network.layers.values()) for role, b in layer.buffers.items()}


def _fnv1a(text: str) -> int:
    h = 0x811C9DC5
    for b in text.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def provenance(doc: dict, what: str) -> str:
    """The comment every generated file opens with: what made it from which schedule, for which
    device and budgets; a reader of a board's sources can tell whether they are still current."""
    dev, budgets = doc.get("device") or {}, doc.get("budgets") or {}
    runtime = budgets.get("runtime_s")
    lines = [
        f"{what}: generated by poet-opt {__version__}, do not edit.",
        f"schedule sha256 {schedule_sha256(doc)} (model {doc.get('model')}, mode {doc.get('mode')})",
        f"device {dev.get('name')} ({dev.get('cpu')}); budgets: RAM {budgets.get('ram_bytes')} B, runtime "
        f"{'unlimited' if runtime is None else f'{runtime:.6g} s'}, storage {budgets.get('storage_bytes')} B",
    ]
    return "/*\n" + "".join(f" * {comment(line)}\n" for line in lines) + " */\n"


class Library:
    """Renders the library of one schedule from a StepWriter (writer.py or strip_codegen.py)."""

    def __init__(self, writer: StepWriter, prefix: str = "poet_"):
        check_library_prefix(prefix)
        self.w, self.p, self.P = writer, prefix, prefix.upper()
        net = writer.net
        logits = net.layers[net.output]
        self.batch = logits.shape[0]
        self.classes = logits.elements // self.batch
        self.input_floats = int(np.prod(net.input_shape))
        # a model whose input goes into embeddings takes int32 token ids, each in [0, vocabulary)
        self.vocabulary = net.vocabulary
        self.input_type = input_c_type(prefix, net.vocabulary)[0]
        self.doc = writer.doc

    # -- saved weights ---------------------------------------------------------------------------

    def saved(self) -> list[tuple[str, int]]:
        """(C array, floats) of each piece of state save_weights keeps: the resident trainable
        weights, and the norms' running statistics (static RAM either way)."""
        out = []
        for layer in self.w.net.layers.values():
            k = self.w.layer_index[layer.name]
            if layer.trainable and not self.w.streamed:
                out += [(identifier("poet", role, k), int(p.value.size)) for role, p in layer.params.items()]
            out += [(identifier("poet", role, k), int(b.value.size)) for role, b in layer.buffers.items()]
        return out

    def save_layout(self, program_end: int) -> tuple[int, list[int], int]:
        """(the area's offset, each piece's offset, the area's end): after the plan's regions and a
        stored step program, on an erase-block boundary so that erasing the area (flash) touches
        nothing else; the header first, then the pieces, each on a 512-byte boundary, whole blocks
        for an SD card, and any offset suits NOR flash."""
        flash = self.w.flash
        block = max(1, int(flash.erase_block))
        end = max([program_end, *(flash.offsets[n] + flash.region_bytes[n] for n in flash.offsets)], default=0)
        start = -(-end // block) * block
        at = start + SAVE_UNIT
        offsets = []
        for _, floats in self.saved():
            offsets.append(at)
            at += -(-4 * floats // SAVE_UNIT) * SAVE_UNIT
        capacity = (self.doc.get("device") or {}).get("storage_capacity_bytes")
        if isinstance(capacity, int) and at > capacity:
            raise PoetError(f"the saved weights ({at - start:,} B from offset {start:,}) do not fit the storage "
                            f"({capacity:,} B) beside the plan's regions", field="--device")
        return start, offsets, at

    # -- sources ---------------------------------------------------------------------------------

    @property
    def input_cast(self) -> str:
        """Token ids go into the input's arena slot word for word (the kernels that copy and page it
        move 4-byte words; the embedding kernels read them as int32: writer.ids)."""
        return "" if self.vocabulary is None else "(const float *)"

    def check_ids(self) -> list[str]:
        """A batch of token ids is checked before the step, as its labels are: the embedding kernels
        would read no row for an id outside the table."""
        if self.vocabulary is None:
            return []
        P = self.P
        return [f"    for (i = 0u; i < {P}INPUT_IDS; ++i) {{",
                f"        if (inputs[i] < 0 || inputs[i] >= (int32_t){P}VOCABULARY) {{",
                f"            return {P}E_TOKEN;", "        }", "    }"]

    def header(self) -> str:
        P, p = self.P, self.p
        guard = f"{P}TRAIN_H"
        shape = " x ".join(str(d) for d in self.w.net.input_shape)
        status = f"{p}status"
        return "\n".join([
            provenance(self.doc, f"{p}train.h, the training step's interface").rstrip("\n"),
            f"#ifndef {guard}",
            f"#define {guard}",
            "",
            "#include <stdint.h>",
            "",
            *([f"/* one batch: {P}INPUT_FLOATS floats of inputs, {shape} in C order; {P}BATCH labels */"]
              if self.vocabulary is None else
              [f"/* one batch: {P}INPUT_IDS token ids (int32, each 0 .. {P}VOCABULARY-1), {shape} in C order; "
               f"{P}BATCH labels */"]),
            f"#define {P}BATCH {self.batch}u",
            *([f"#define {P}INPUT_FLOATS {self.input_floats}u"] if self.vocabulary is None else
              [f"#define {P}INPUT_IDS {self.input_floats}u", f"#define {P}VOCABULARY {self.vocabulary}u"]),
            f"#define {P}CLASSES {self.classes}u",
            f"#define {P}LOGITS_FLOATS {self.batch * self.classes}u",
            "",
            "typedef enum {",
            *(f"    {P}{s} = {v}, /* {text} */" for s, v, text in STATUSES[:-1]),
            f"    {P}{STATUSES[-1][0]} = {STATUSES[-1][1]} /* {STATUSES[-1][2]} */",
            f"}} {status};",
            "",
            "/* Call once after reset, before any other function. */",
            f"{status} {p}init(void);",
            "",
            "/* One SGD step at learning rate lr on the batch inputs with labels (each 0 .. CLASSES-1);",
            " * loss receives the batch's mean cross-entropy before the step. The pointers are read",
            " * during the call only. */",
            f"{status} {p}train_step(const {self.input_type} *inputs, const int32_t *labels, float lr, float *loss);",
            "",
            f"/* The forward pass with the current weights: logits receives {P}LOGITS_FLOATS floats",
            " * (batch x classes), as PyTorch's model.eval(): batch norm normalises with its running",
            " * statistics and moves none, so each sample's logits depend on that sample alone. */",
            f"{status} {p}predict(const {self.input_type} *inputs, float *logits);",
            "",
            "/* Write what training changed to the storage device, after the plan's regions; load it",
            f" * back after a reset ({P}E_NO_SAVED_WEIGHTS if none was saved by this model). */",
            f"{status} {p}save_weights(void);",
            f"{status} {p}load_weights(void);",
            "",
            f"#endif /* {guard} */",
            "",
        ])

    def source(self, interpreter: list[str], run: list[str], forward: list[str] | None,
               program_end: int, storage_defines: dict | None = None) -> str:
        w, P, p = self.w, self.P, self.p
        status = f"{p}status"
        zero, sgd = [], []
        for layer in w.net.layers.values():
            if not layer.trainable or w.streamed:
                continue
            k = w.layer_index[layer.name]
            for role, prm in layer.params.items():
                zero.append(f"    poet_zero({identifier('poet', 'g' + role, k)}, {prm.value.size}u);")
                sgd.append(f"    poet_sgd_step({identifier('poet', role, k)}, {identifier('poet', 'g' + role, k)}, "
                           f"{prm.value.size}u, poet_lr);")
        plan = w.plan
        arena_words = max(1, -(-plan.arena_bytes // 4))
        align = max(4, int(plan.alignment))
        header_at, offsets, end = self.save_layout(program_end)
        pieces = self.saved()
        layout = _fnv1a("poet-opt saved weights 1: " + ",".join(str(f) for _, f in pieces))
        nbytes = 4 * sum(f for _, f in pieces)
        logits_at = plan.step_offsets[w.logits_step()] // 4
        section = "." + identifier(p + "arena")
        if forward is None:
            predict_body = ["    (void)inputs;", "    (void)logits;", f"    return {P}E_UNSUPPORTED;"]
        else:
            predict_body = [
                f"    if (!poet_ready) {{", f"        return {P}E_NOT_INITIALIZED;", "    }",
                "    if (inputs == NULL || logits == NULL) {", f"        return {P}E_ARGUMENT;", "    }",
                *self.check_ids(), f"    poet_input = {self.input_cast}inputs;", "    rc = poet_forward(logits);",
                "    poet_input = NULL;",
                f"    return ({status})rc;"]
        return "\n".join([
            provenance(self.doc, f"{p}train.c, the training step of {w.net.name}").rstrip("\n"),
            "#include <stddef.h>",
            "#include <stdint.h>",
            '#include "poet_kernels.h"',
            '#include "poet_paging.h"',
            '#include "poet_storage.h"',
            f'#include "{p}train.h"',
            "",
            *(["/* The storage geometry poet_storage.h requires, as the emulator defined it for this device:",
                *(f" *   -D{comment(key)}={comment(value)}" for key, value in storage_defines.items()),
                " * A board defines these for its own part. */", ""] if storage_defines else []),
            f"#if POET_STORAGE_CAPACITY_BYTES < {end}u",
            f'#error "the plan\'s regions and the saved weights need {end} bytes of storage"',
            "#endif",
            "",
            "/* the plan's arena: aligned as the plan was laid out, in a section the linker script places */",
            f'static float poet_arena[{arena_words}] __attribute__((aligned({align}), section("{section}")));',
            "/* the caller's batch and learning rate, for the duration of a call */",
            "static const float *poet_input;",
            "static const int32_t *poet_labels;",
            "static float poet_lr;",
            "static int poet_ready;",
            "",
            *w.decls,
            *w.weights_comment(),
            *(MARK_FUNCTION if w.marks else []),
            *interpreter,
            "static int poet_step(float *loss)",
            "{",
            "    int rc = 0;",
            *zero,
            *("    " + line for line in run),
            *sgd,
            "    return rc;",
            "}",
            "",
            *([] if forward is None else [
                "static int poet_forward(float *logits)",
                "{",
                "    int rc = 0;",
                *("    " + line for line in forward),
                f"    poet_copy(logits, (poet_arena + {logits_at}u), {self.batch * self.classes}u);",
                "    return rc;",
                "}",
                "",
            ]),
            f"{status} {p}init(void)",
            "{",
            "    poet_ready = 1;",
            f"    return {P}OK;",
            "}",
            "",
            f"{status} {p}train_step(const {self.input_type} *inputs, const int32_t *labels, float lr, float *loss)",
            "{",
            "    uint32_t i;",
            "    int rc;",
            "    if (!poet_ready) {", f"        return {P}E_NOT_INITIALIZED;", "    }",
            "    /* lr - lr is NaN for an infinite lr */",
            "    if (inputs == NULL || labels == NULL || loss == NULL || !(lr > 0.0f) || !(lr - lr == 0.0f)) {",
            f"        return {P}E_ARGUMENT;", "    }",
            f"    for (i = 0u; i < {self.batch}u; ++i) {{",
            f"        if (labels[i] < 0 || labels[i] >= {self.classes}) {{", f"            return {P}E_LABEL;",
            "        }", "    }",
            *self.check_ids(),
            f"    poet_input = {self.input_cast}inputs;",
            "    poet_labels = labels;",
            "    poet_lr = lr;",
            "    rc = poet_step(loss);",
            "    poet_input = NULL;",
            "    poet_labels = NULL;",
            f"    return ({status})rc;",
            "}",
            "",
            f"{status} {p}predict(const {self.input_type} *inputs, float *logits)",
            "{",
            *(["    int rc;", *(["    uint32_t i;"] if self.vocabulary is not None else [])] if forward is not None else []),
            *predict_body,
            "}",
            "",
            "/* the saved-weights header: magic, layout hash, bytes; zero while a save is under way */",
            "typedef union {",
            "    float f[4];",
            "    uint32_t u[4];",
            "} poet_saved_header;",
            "static poet_saved_header poet_header;",
            "",
            "/* flash: the area's blocks erased at once (the header with them), then programmed; an SD",
            " * card: whole blocks, the header zeroed first. The header goes last either way. */",
            "static int poet_save_piece(uint32_t offset, const float *src, uint32_t bytes)",
            "{",
            "#if POET_STORAGE_ERASE_REQUIRED",
            "    return poet_storage_write(offset, src, bytes);",
            "#else",
            "    return poet_page_out(offset, src, bytes);",
            "#endif",
            "}",
            "",
            f"{status} {p}save_weights(void)",
            "{",
            "    int rc;",
            "#if POET_STORAGE_ERASE_REQUIRED",
            "    uint32_t block;",
            "#endif",
            "    if (!poet_ready) {", f"        return {P}E_NOT_INITIALIZED;", "    }",
            "#if POET_STORAGE_ERASE_REQUIRED",
            f"    for (block = {header_at}u / POET_STORAGE_ERASE_BLOCK_BYTES; "
            f"block < ({end}u + POET_STORAGE_ERASE_BLOCK_BYTES - 1u) / POET_STORAGE_ERASE_BLOCK_BYTES; ++block) {{",
            "        rc = poet_storage_erase(block);",
            f"        if (rc) {{", f"            return ({status})rc;", "        }",
            "    }",
            "#else",
            "    poet_header.u[0] = poet_header.u[1] = poet_header.u[2] = poet_header.u[3] = 0u;",
            f"    rc = poet_page_out({header_at}u, poet_header.f, {HEADER_BYTES}u);",
            f"    if (rc) {{", f"        return ({status})rc;", "    }",
            "#endif",
            *(line for (array, floats), at in zip(pieces, offsets) for line in (
                f"    rc = poet_save_piece({at}u, {array}, {4 * floats}u);",
                "    if (rc) {", f"        return ({status})rc;", "    }")),
            f"    poet_header.u[0] = 0x{SAVED_MAGIC:08X}u;",
            f"    poet_header.u[1] = 0x{layout:08X}u;",
            f"    poet_header.u[2] = {nbytes}u;",
            "    poet_header.u[3] = 0u;",
            f"    return ({status})poet_save_piece({header_at}u, poet_header.f, {HEADER_BYTES}u);",
            "}",
            "",
            f"{status} {p}load_weights(void)",
            "{",
            "    int rc;",
            "    if (!poet_ready) {", f"        return {P}E_NOT_INITIALIZED;", "    }",
            f"    rc = poet_page_in({header_at}u, poet_header.f, {HEADER_BYTES}u);",
            f"    if (rc) {{", f"        return ({status})rc;", "    }",
            f"    if (poet_header.u[0] != 0x{SAVED_MAGIC:08X}u || poet_header.u[1] != 0x{layout:08X}u || "
            f"poet_header.u[2] != {nbytes}u) {{",
            f"        return {P}E_NO_SAVED_WEIGHTS;", "    }",
            *(line for (array, floats), at in zip(pieces, offsets) for line in (
                f"    rc = poet_page_in({at}u, {array}, {4 * floats}u);",
                "    if (rc) {", f"        return ({status})rc;", "    }")),
            f"    return {P}OK;",
            "}",
            "",
        ])

    def harness(self, steps: int, lr: float, x: np.ndarray, y: np.ndarray) -> str:
        """The emulator's main(): ``steps`` steps on one batch at ``lr``, each loss kept for the
        host; an application's main() calls the same functions on its own batches."""
        p, P = self.p, self.P
        return "\n".join([
            provenance(self.doc, f"{HARNESS_FILE}, the example main() the emulator runs").rstrip("\n"),
            "#include <stdint.h>",
            f'#include "{p}train.h"',
            "",
            f"#define HARNESS_STEPS {steps}u",
            "",
            c_array(self.input_type, "harness_input", x.astype(np.float32 if self.vocabulary is None else np.int64),
                    const=True),
            c_array("int32_t", "harness_labels", y.astype(np.int64), const=True),
            f"__attribute__((used)) float {HARNESS_LOSSES}[HARNESS_STEPS];",
            "",
            "int main(void)",
            "{",
            "    uint32_t s;",
            f"    {p}status rc = {p}init();",
            "    for (s = 0u; rc == " + f"{P}OK && s < HARNESS_STEPS; ++s) {{",
            f"        rc = {p}train_step(harness_input, harness_labels, {float_literal(lr, field='--lr')}, "
            f"&{HARNESS_LOSSES}[s]);",
            "    }",
            "    return (int)rc;",
            "}",
            "",
        ])


def render(writer: StepWriter, *, steps: int, lr: float, x: np.ndarray, y: np.ndarray,
           prefix: str = "poet_", storage_defines: dict | None = None) -> GeneratedStep:
    from poet_opt.firmware import program

    lib = Library(writer, prefix)
    writer.declare()
    body = writer.step_body()
    forward = writer.step_body(upto=writer.logits_step() + 1, predict=True)
    calls = sum(1 for line in forward if line.startswith("poet_") or line.startswith("rc = "))
    if calls > program.PROGRAM_CALLS:
        forward = None  # as a program it would need a second interpreter; see STATUSES
    writer.finish(body + (forward or []))
    run, interpreter, code, offset = writer.as_program(body)
    program_end = 0 if offset is None else offset + len(code)
    source = lib.source(interpreter, run, forward, program_end, storage_defines)
    return GeneratedStep(source, dict(writer.param_symbols), steps, dict(writer.param_layers), code, offset,
                         header=lib.header(), harness=lib.harness(steps, lr, x, y), prefix=prefix)

