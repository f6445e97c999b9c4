"""A schedule as one self-contained C99 header: step table, operand offsets, node table.

Firmware walks PREFIX_STEPS in order against one static arena of PREFIX_ARENA_BYTES and a flash
partition of PREFIX_FLASH_BYTES (docs/c-export.md). The header holds only constants: no code, no
malloc, nothing beyond <stdint.h>.
"""

from __future__ import annotations

import re

from poet_opt import __version__
from poet_opt.errors import PoetError
from poet_opt.firmware.arena import ArenaPlan, FlashPlan

KINDS = {"compute": "COMPUTE", "page_out": "PAGE_OUT", "page_in": "PAGE_IN", "free": "FREE"}
_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _uint(limit: int) -> str:
    for bits in (8, 16, 32):
        if limit < (1 << bits):
            return f"uint{bits}_t"
    raise PoetError(f"a value of {limit:,} does not fit the header's 32-bit fields")


def _comment(text) -> str:
    """Text from the schedule (model, graph, device names) inside a /* */ comment: printable ASCII
    only, with whatever could end the comment ("*/"), open a nested one ("/*", -Wcomment), form a
    trigraph ("??/" is a backslash under -std=c99) or splice lines (a trailing backslash) written as
    \\xNN / \\uNNNN escapes, so the header compiles warning-free whatever a name holds."""
    text = " ".join(str(text).split())
    out = []
    for k, ch in enumerate(text):
        before, after = text[k - 1:k], text[k + 1:k + 2]
        risky = ch == "\\" or (ch == "/" and "*" in (before, after)) or (ch == "?" and after == "?")
        if risky or not " " <= ch <= "~":
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def _c_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\?':  # "?" escaped: "??" could start a trigraph under -std=c99
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        else:  # non-ASCII as UTF-8 octal escapes: octal never swallows a following digit beyond 3
            # surrogatepass: JSON may carry a lone surrogate, which has no UTF-8; keep its code unit
            out.extend(f"\\{b:03o}" for b in ch.encode("utf-8", "surrogatepass"))
    return '"' + "".join(out) + '"'


def _rows(items: list[str], per_line: int) -> str:
    """Array body; a 1-element dummy when empty, since C forbids zero-length arrays."""
    items = items or ["0"]
    return "\n".join("    " + ", ".join(items[k:k + per_line]) + "," for k in range(0, len(items), per_line))


def check_prefix(prefix: str) -> None:
    if not _PREFIX.match(prefix):
        raise PoetError(f"{prefix!r} is not a C identifier prefix (letters, digits, _; not starting with a digit)",
                        field="--prefix")


def render_header(doc: dict, plan: ArenaPlan, flash: FlashPlan, *, prefix: str = "POET_") -> str:
    check_prefix(prefix)
    P = prefix
    nodes, steps = doc["graph"]["nodes"], doc["steps"]
    operands: list[int] = []
    operand_nodes: list[int] = []  # which node each operand is: the runtime's debug build checks it is live there
    first: list[int] = []
    for step, offs in zip(steps, plan.operand_offsets):
        first.append(len(operands))
        operands.extend(offs)
        if offs:
            operand_nodes.extend(int(d) for d in nodes[step["node"]]["deps"])
    assert len(operand_nodes) == len(operands)
    max_operands = max((len(o) for o in plan.operand_offsets), default=0)

    node_t = _uint(len(nodes) - 1)
    first_t = _uint(max(len(operands), 1))
    count_t = _uint(max_operands)
    _uint(max(plan.arena_bytes, flash.flash_bytes, max((int(n["bytes"]) for n in nodes), default=0)))

    rows = []
    for s, step in enumerate(steps):
        op, n = step["op"], step["node"]
        # a compute of streamed weights reads them from their region
        reads = op in ("page_out", "page_in") or (op == "compute" and n in flash.params)
        fl = flash.offsets.get(n, 0) if reads else 0
        rows.append(f"    {{{P}{KINDS[op]}, {n}u, {plan.step_offsets[s]}u, {fl}u, {int(nodes[n]['bytes'])}u, "
                    f"{first[s] if plan.operand_offsets[s] else 0}u, {len(plan.operand_offsets[s])}u}},")

    dev, budgets, totals = doc["device"], doc["budgets"], doc["totals"]
    solver = doc.get("solver") if isinstance(doc.get("solver"), dict) else {}
    gap = solver.get("gap")
    runtime = budgets.get("runtime_s")
    guard = f"{P.upper()}SCHEDULE_H"
    lifetime = _lifetime_text(flash)
    info = [
        f"model {doc.get('model')} (graph {doc['graph'].get('name')}), mode {doc.get('mode')}",
        f"device {dev.get('name')} ({dev.get('cpu')}), alignment {plan.alignment} B, "
        f"erase block {flash.erase_block} B, endurance {flash.endurance_cycles} cycles",
        f"budgets: RAM {budgets['ram_bytes']} B, runtime {'unlimited' if runtime is None else f'{runtime:.6g} s'}, "
        f"storage {budgets['storage_bytes']} B",
        f"energy {totals['energy_j']:.6g} J per training step (compute {totals['compute_j']:.6g} J, "
        f"page in {totals['page_in_j']:.6g} J, page out {totals['page_out_j']:.6g} J), runtime {totals['runtime_s']:.6g} s",
        f"arena {plan.arena_bytes} B for a live peak of {plan.live_peak_bytes} B ({plan.ratio:.4f}x, {plan.strategy})",
        f"flash {flash.flash_bytes} B, {flash.bytes_written_per_step} B written per training step, "
        f"flash lifetime {lifetime}",
        f"solver {solver.get('backend')} {solver.get('status')}, gap "
        f"{f'{gap:.3g}' if isinstance(gap, (int, float)) else gap}",
        f"generated by {doc.get('generator')} (schedule), poet-opt {__version__} (header)",
    ]
    unused = f"{P}UNUSED"
    names = ",\n".join(f"    {_c_string(str(n['name']))}" for n in nodes)
    out = [
        "/* Training schedule for firmware, generated by poet-opt export: do not edit.",
        *[f" * {_comment(line)}" for line in info],
        " *",
        " * Walk the steps in order: docs/c-export.md. Offsets are bytes from the start of the arena",
        f" * (an array of {P}ARENA_BYTES bytes aligned to {plan.alignment}) or of the flash partition.",
        " */",
        f"#ifndef {guard}",
        f"#define {guard}",
        "",
        "#include <stdint.h>",
        "",
        "/* static const tables a translation unit does not read must not warn */",
        "#if defined(__GNUC__)",
        f"#define {unused} __attribute__((unused))",
        "#else",
        f"#define {unused}",
        "#endif",
        "",
        f"#define {P}ARENA_BYTES {plan.arena_bytes}u",
        f"#define {P}ARENA_ALIGNMENT {plan.alignment}u",
        f"#define {P}LIVE_PEAK_BYTES {plan.live_peak_bytes}u",
        f"#define {P}FLASH_BYTES {flash.flash_bytes}u",
        f"#define {P}ERASE_BLOCK_BYTES {flash.erase_block}u",
        "/* storage regions (streamed weights, paged tensors) start on multiples of this: erase blocks",
        "   of their own on raw flash, 512-byte sectors packed on a wear-levelled block device */",
        f"#define {P}REGION_ALIGNMENT_BYTES {512 if flash.packed else flash.erase_block}u",
        f"#define {P}NUM_STEPS {len(steps)}u",
        f"#define {P}NUM_TENSORS {len(nodes)}u",
        f"#define {P}NUM_OPERANDS {len(operands)}u",
        f"#define {P}MAX_OPERANDS {max_operands}u",
        "",
        f"enum {{ {', '.join(f'{P}{k} = {i}' for i, k in enumerate(KINDS.values()))} }};",
        "",
        "typedef struct {",
        *(f"    {f'{ctype} {name};':<24}/* {text} */" for ctype, name, text in [
            ("uint8_t", "kind", f"{P}COMPUTE, {P}PAGE_OUT, {P}PAGE_IN or {P}FREE"),
            (node_t, "node", f"node id: index into {P}NODE_BYTES"),
            ("uint32_t", "arena_offset", "where the node's tensor lives during this residency"),
            ("uint32_t", "flash_offset", "page_out / page_in, compute of weights: the node's flash region; else 0"),
            ("uint32_t", "bytes", "size of the node's tensor"),
            (first_t, "first_operand", f"compute: index of its first input in {P}OPERANDS"),
            (count_t, "num_operands", "compute: number of inputs (the node's deps, in order); else 0"),
        ]),
        f"}} {P}step_t;",
        "",
        f"static const {P}step_t {P}STEPS[{max(len(steps), 1)}] {unused} = {{",
        *(rows or [f"    {{{P}FREE, 0u, 0u, 0u, 0u, 0u, 0u}},  /* dummy: no steps */"]),
        "};",
        "",
        f"/* arena offsets of the inputs of compute steps, {P}STEPS[s].first_operand onwards */",
        f"static const uint32_t {P}OPERANDS[{max(len(operands), 1)}] {unused} = {{",
        _rows([f"{o}u" for o in operands], 8),
        "};",
        "",
        f"/* node id of each entry of {P}OPERANDS: the deps of the step's node, in order */",
        f"static const {node_t} {P}OPERAND_NODES[{max(len(operands), 1)}] {unused} = {{",
        _rows([f"{d}u" for d in operand_nodes], 12),
        "};",
        "",
        "/* bytes of each node's output tensor, by node id */",
        f"static const uint32_t {P}NODE_BYTES[{len(nodes)}] {unused} = {{",
        _rows([f"{int(n['bytes'])}u" for n in nodes], 8),
        "};",
        "",
        *_streamed_weights(P, unused, nodes, flash, node_t),
        f"#ifdef {P}WITH_NAMES",
        f"static const char *const {P}NODE_NAMES[{len(nodes)}] {unused} = {{",
        names + ",",
        "};",
        f"#endif /* {P}WITH_NAMES */",
        "",
        f"#endif /* {guard} */",
        "",
    ]
    return "\n".join(out)


def _streamed_weights(P: str, unused: str, nodes: list, flash: FlashPlan, node_t: str) -> list[str]:
    """Where streamed weights live and which nodes write them back (docs/c-export.md); nothing for
    a plan with resident weights, whose header stays as it was."""
    if not flash.params:
        return []
    updates = [(n, list(node.get("updates", ()))) for n, node in enumerate(nodes) if node.get("updates")]
    listed = [p for _, ps in updates for p in ps]
    first, count, at = [0] * len(nodes), [0] * len(nodes), 0
    for n, ps in updates:
        first[n], count[n], at = at, len(ps), at + len(ps)
    end = max(flash.offsets[p] + flash.region_bytes[p] for p in flash.params)
    return [
        f"/* streamed weights: the first {P}WEIGHTS_BYTES of the flash partition hold every layer's weights",
        " * (weight, then bias, fp32), one erase-block-aligned region per weights node, provisioned before",
        " * the first step; a COMPUTE of a weights node reads its region into the arena */",
        f"#define {P}WEIGHTS_BYTES {end}u",
        f"#define {P}NUM_WEIGHT_NODES {len(flash.params)}u",
        f"static const uint32_t {P}NODE_FLASH_OFFSETS[{len(nodes)}] {unused} = {{  /* 0xFFFFFFFF: no region */",
        _rows([f"{flash.offsets[n]}u" if n in flash.params else "0xFFFFFFFFu" for n in range(len(nodes))], 8),
        "};",
        "",
        f"/* a COMPUTE of node n updates weights in place, then writes {P}UPDATE_COUNTS[n] weights nodes back",
        f" * to their regions: {P}UPDATE_NODES[{P}UPDATE_FIRST[n]] onwards (erase before program on flash) */",
        f"static const uint32_t {P}UPDATE_FIRST[{len(nodes)}] {unused} = {{",
        _rows([f"{v}u" for v in first], 8),
        "};",
        f"static const uint32_t {P}UPDATE_COUNTS[{len(nodes)}] {unused} = {{",
        _rows([f"{v}u" for v in count], 8),
        "};",
        f"static const {node_t} {P}UPDATE_NODES[{max(len(listed), 1)}] {unused} = {{",
        _rows([f"{p}u" for p in listed], 12),
        "};",
        "",
    ]


def export(doc: dict, *, prefix: str = "POET_", source: str | None = None) -> tuple[str, ArenaPlan, FlashPlan]:
    """Plan arena and flash for a validated schedule document and render its header; PoetError if
    the arena does not fit the schedule's RAM budget."""
    from poet_opt.firmware.arena import check_fits, plan_arena, plan_flash

    try:
        plan = plan_arena(doc)
        check_fits(doc, plan)
        flash = plan_flash(doc)
        return render_header(doc, plan, flash, prefix=prefix), plan, flash
    except PoetError as exc:  # name the schedule file in the one line the CLI prints
        if exc.source or not source:
            raise
        raise type(exc)(exc.message, source=source, field=exc.field) from None


def _lifetime_text(flash: FlashPlan) -> str:
    if flash.lifetime_steps is None:
        return "unlimited (nothing paged)"
    how = "wear levelled over the whole medium" if flash.wear_levelling else "each region erased once per step"
    return f"{flash.lifetime_steps:,} training steps ({how})"


def export_summary(plan: ArenaPlan, flash: FlashPlan) -> str:
    from poet_opt.units import format_bytes

    life = _lifetime_text(flash)
    return "\n".join([
        f"  arena    {format_bytes(plan.arena_bytes)} ({plan.arena_bytes:,} B) for a live peak of "
        f"{format_bytes(plan.live_peak_bytes)}: {plan.ratio:.4f}x",
        f"  flash    {format_bytes(flash.flash_bytes)} in {len(flash.offsets)} regions, "
        f"{format_bytes(flash.bytes_written_per_step)} written per training step",
        f"  lifetime {life}",
    ])
