"""Independent validator for `poet-opt/schedule@1` files (contract: docs/schedule-format.md).

It replays the steps from scratch and shares no code with the graph, cost model or solver (only
the error type), so a bug there cannot vouch for itself by being repeated here. The replay rules
are schedule/walk.py's, the walk the firmware generator and the executors follow too: what the
validator accepts is what they run. Two kinds of failure:
a document that is not a readable schedule raises PoetError (exit 2); a schedule that breaks a
rule, a budget or its own totals raises ScheduleInvalid (exit 1) naming the first violation.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from poet_opt.errors import PoetError
from poet_opt.schedule.walk import OPS, ScheduleInvalid, shown, walk

FORMAT = "poet-opt/schedule@1"
COST_KEYS = ("compute_s", "compute_j", "page_out_s", "page_out_j", "page_in_s", "page_in_j")
BUDGET_KEYS = ("ram_bytes", "runtime_s", "storage_bytes")
# Same order as the docs; True marks the integer counts, which must match exactly.
TOTAL_KEYS = {
    "energy_j": False, "compute_j": False, "page_in_j": False, "page_out_j": False, "runtime_s": False,
    "peak_ram_bytes": True, "storage_bytes": True, "computes": True, "recomputes": True,
    "page_ins": True, "page_outs": True,
}
# Storage traffic, in files since weights can be streamed (older files lack them: not checked then).
TRAFFIC_KEYS = ("storage_read_bytes", "storage_written_bytes")
MEMORY_KEYS = ("param_bytes", "param_grad_bytes", "working_peak_bytes", "total_bytes")
REL_TOL, ABS_TOL = 1e-6, 1e-12
# Sane limits, so that every sum over the steps stays finite (docs/schedule-format.md): sizes and
# counts fit a signed 64-bit integer; times and energies, one node's or a total, at most
# units.MAX_QUANTITY (any 2^64 of them add up to a finite float).
MAX_INTEGER = 2**63 - 1
# units.MAX_QUANTITY, written out here: the validator shares no code with what it checks (a test
# keeps the two equal)
MAX_QUANTITY = sys.float_info.max / 2**64
# The device section's sizes and counts (docs/schedule-format.md); the last four must be positive.
DEVICE_INTEGERS = ("ram_bytes", "bytes_per_element", "alignment_bytes", "storage_capacity_bytes",
                   "erase_block_bytes", "endurance_cycles", "stack_reserve_bytes")
DEVICE_POSITIVE = ("bytes_per_element", "alignment_bytes", "erase_block_bytes", "endurance_cycles")
# the storage kinds of docs/profiles.md; kept here, not imported, as the validator shares no code
STORAGE_KINDS = ("sd-card", "spi-flash", "qspi-flash", "internal-flash", "emmc", "nvme", "ssd", "usb")
# Solvers hit the runtime budget with equality; this absorbs their floating-point noise.
RUNTIME_SLACK = 1e-9


def _number(value, where: str, source, *, integer=False, signed=False, most=None):
    kind = "integer" if integer else "number"
    # An int is compared as it is: one of 400 digits has no float (math.isfinite would raise).
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        (isinstance(value, int) or math.isfinite(value))
    if ok and integer:
        ok = isinstance(value, int) or value.is_integer()
    if ok and not signed:
        ok = value >= 0
    if not ok:
        need = kind if signed else f"non-negative {kind}"
        raise PoetError(f"{where} is {shown(value)}; expected a {need}", source=source)
    most = most or (MAX_INTEGER if integer else MAX_QUANTITY)
    if abs(value) > most:
        limit = "2^63 - 1" if most == MAX_INTEGER else f"{most:.4g}"
        raise PoetError(f"{where} is {shown(value)}; expected at most {limit}", source=source)
    return int(value) if integer else float(value)


def _section(doc: dict, key: str, kind: type, source):
    if key not in doc:
        raise PoetError(f"the schedule has no {key!r} section", source=source)
    if not isinstance(doc[key], kind):
        raise PoetError(f"{key} is a {type(doc[key]).__name__}; expected a JSON {kind.__name__}", source=source)
    return doc[key]


def _read_plan(doc, source) -> dict:
    """Check the parts a replay needs (format, graph, budgets, steps); PoetError if they are not a schedule."""
    if not isinstance(doc, dict):
        raise PoetError(f"not a poet-opt schedule: expected a JSON object, got a {type(doc).__name__}", source=source)
    fmt = doc.get("format")
    if fmt != FORMAT:
        version = re.fullmatch(r"poet-opt/schedule@(.*)", fmt) if isinstance(fmt, str) else None
        if "format" not in doc:
            problem = "not a poet-opt schedule: it has no 'format' field"
        elif version:
            problem = f"format {shown(fmt)} is schedule version {shown(version[1])}, which this poet-opt cannot read"
        else:
            problem = f"not a poet-opt schedule: format is {shown(fmt)}"
        raise PoetError(f"{problem}; the supported format is {FORMAT!r}", source=source)

    nodes = _section(doc, "graph", dict, source).get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise PoetError("graph.nodes must be a non-empty list of nodes", source=source)
    names, size, deps, cost = [], [], [], {k: [] for k in COST_KEYS}
    reads, writes, updates = [], [], []
    for i, node in enumerate(nodes):
        where = f"graph.nodes[{i}]"
        if not isinstance(node, dict):
            raise PoetError(f"{where} is not a JSON object", source=source)
        if node.get("id") != i or isinstance(node.get("id"), bool):
            raise PoetError(f"{where} has id {shown(node.get('id'))}; nodes must be listed in topological order "
                            f"with id equal to their index", source=source)
        if not isinstance(node.get("name"), str):
            raise PoetError(f"{where}.name is {shown(node.get('name'))}; expected a string", source=source)
        names.append(node["name"])
        where = f"node {i} {shown(node['name'])}"
        size.append(_number(node.get("bytes"), f"{where}: bytes", source, integer=True))
        for key in COST_KEYS:
            cost[key].append(_number(node.get(key), f"{where}: {key}", source))
        node_deps = node.get("deps")
        if not isinstance(node_deps, list):
            raise PoetError(f"{where}: deps is {shown(node_deps)}; expected a list of node ids", source=source)
        for d in node_deps:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise PoetError(f"{where}: deps contains {shown(d)}; expected node ids", source=source)
            if d >= i:
                raise PoetError(f"{where} depends on node {d}; the graph is not in topological order "
                                f"(every dep must be smaller than the node's id)", source=source)
        deps.append(tuple(node_deps))
        # read from storage when computed: a training sample, or streamed weights (op "param")
        reads.append(node.get("op") in ("input", "param"))
        writes.append(_number(node.get("writes_bytes", 0), f"{where}: writes_bytes", source, integer=True))
        node_updates = node.get("updates", [])
        if not isinstance(node_updates, list) or any(isinstance(p, bool) or not isinstance(p, int)
                                                     or p not in node_deps for p in node_updates):
            raise PoetError(f"{where}: updates is {shown(node_updates)}; expected ids among its deps "
                            "(the weights it changes in place)", source=source)
        updates.append(tuple(node_updates))

    budgets = _section(doc, "budgets", dict, source)
    for key in BUDGET_KEYS:
        if key not in budgets:
            raise PoetError(f"budgets has no {key!r}", source=source)
    # null: no such budget was set (no runtime limit), so there is nothing to enforce; every plan
    # has a RAM budget, what its header's arena is checked against (docs/schedule-format.md)
    if budgets["ram_bytes"] is None:
        raise PoetError("budgets.ram_bytes is null; expected a non-negative integer (bytes)", source=source)
    limits = {k: None if budgets[k] is None else
              _number(budgets[k], f"budgets.{k}", source, most=None if k == "runtime_s" else MAX_INTEGER)
              for k in BUDGET_KEYS}
    if budgets.get("min_lifetime_steps") is not None:
        if _number(budgets["min_lifetime_steps"], "budgets.min_lifetime_steps", source, integer=True) < 1:
            raise PoetError("budgets.min_lifetime_steps is 0; expected a positive whole number or null", source=source)
    _read_device(doc, source)

    steps = []
    for k, step in enumerate(_section(doc, "steps", list, source)):
        if not isinstance(step, dict) or "op" not in step or "node" not in step:
            raise PoetError(f"step {k} is {shown(step)}; expected {{\"op\": ..., \"node\": id}}", source=source)
        op, n = step["op"], step["node"]
        if op not in OPS:
            raise PoetError(f"step {k} has unknown op {shown(op)}; expected one of {', '.join(OPS)}", source=source)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < len(nodes):
            raise PoetError(f"step {k} ({op}) refers to node {shown(n)}, but the graph has nodes 0..{len(nodes) - 1}",
                            source=source)
        steps.append((op, n))
    return {"names": names, "size": size, "deps": deps, "cost": cost, "limits": limits, "steps": steps,
            "reads": reads, "writes": writes, "updates": updates}


def _read_device(doc: dict, source) -> None:
    """The ``device`` section, where a file has one: what the header, the wear check and the
    summaries read from it must be numbers of the right kind and a storage kind the cost model knows."""
    if "device" not in doc:
        return
    device = _section(doc, "device", dict, source)
    for key in DEVICE_INTEGERS:
        if device.get(key) is not None:
            _number(device[key], f"device.{key}", source, integer=True)
    for key in DEVICE_POSITIVE:
        if device.get(key) is not None and device[key] < 1:
            raise PoetError(f"device.{key} is {shown(device[key])}; expected a positive integer", source=source)
    kind = device.get("storage_kind")
    if kind is not None and kind not in STORAGE_KINDS:
        raise PoetError(f"device.storage_kind is {shown(kind)}; expected one of {', '.join(STORAGE_KINDS)}",
                        source=source)
    for key in ("wear_levelling", "write_cache", "sequential_writes"):
        if device.get(key) is not None and not isinstance(device[key], bool):
            raise PoetError(f"device.{key} is {shown(device[key])}; expected true or false", source=source)


def _read_reported(doc: dict, source) -> tuple[dict, dict | None]:
    totals = _section(doc, "totals", dict, source)
    reported = {}
    for key, integer in TOTAL_KEYS.items():
        if key not in totals:
            raise PoetError(f"totals has no {key!r}", source=source)
        reported[key] = _number(totals[key], f"totals.{key}", source, integer=integer, signed=True)
    if "memory" not in doc:
        return reported, None
    memory = _section(doc, "memory", dict, source)
    for key in MEMORY_KEYS:
        if key not in memory:
            raise PoetError(f"memory has no {key!r}", source=source)
    return reported, {k: _number(memory[k], f"memory.{k}", source, integer=True, signed=True) for k in MEMORY_KEYS}


def _b(x) -> str:
    return f"{int(x):,} B" if float(x).is_integer() else f"{x:,.1f} B"


def _replay(plan: dict, source) -> dict:
    names, size, deps, cost, limits = (plan[k] for k in ("names", "size", "deps", "cost", "limits"))
    ram = storage = peak = 0
    spent = {k: [] for k in COST_KEYS}  # per-step amounts, summed with fsum at the end
    counts = dict.fromkeys(OPS, 0)
    read_bytes = written_bytes = 0

    # the replay rules are the walk's, the backends' own (schedule/walk.py); here the budgets and totals
    for k, op, n, first in walk(plan["steps"], deps, plan["updates"], names, source=source):
        def invalid(what: str):
            return ScheduleInvalid(f"step {k} ({op} node {n} {shown(names[n])}): {what}", source=source)

        counts[op] += 1
        if op == "compute":
            read_bytes += size[n] if plan["reads"][n] else 0
            written_bytes += plan["writes"][n]
        if op in ("compute", "page_in"):
            ram += size[n]
            peak = max(peak, ram)
            if limits["ram_bytes"] is not None and ram > limits["ram_bytes"]:
                raise invalid(f"RAM in use {_b(ram)} exceeds the budget ram_bytes {_b(limits['ram_bytes'])}")
        elif op == "free":
            ram -= size[n]
        if op == "page_in":
            read_bytes += size[n]
        elif op == "page_out":
            written_bytes += size[n]
        if op == "page_out" and first:  # a tensor paged out again reuses its storage copy
            storage += size[n]
            if limits["storage_bytes"] is not None and storage > limits["storage_bytes"]:
                raise invalid(f"storage in use {_b(storage)} exceeds the budget storage_bytes "
                              f"{_b(limits['storage_bytes'])}")
        if op != "free":
            spent[f"{op}_s"].append(cost[f"{op}_s"][n])
            spent[f"{op}_j"].append(cost[f"{op}_j"][n])

    runtime = math.fsum(spent["compute_s"] + spent["page_in_s"] + spent["page_out_s"])
    if limits["runtime_s"] is not None and runtime > limits["runtime_s"] * (1 + RUNTIME_SLACK):
        raise ScheduleInvalid(f"runtime {runtime:.12g} s (sum of all steps) exceeds the budget runtime_s "
                              f"{limits['runtime_s']:.12g} s", source=source)
    return {
        "energy_j": math.fsum(spent["compute_j"] + spent["page_in_j"] + spent["page_out_j"]),
        "compute_j": math.fsum(spent["compute_j"]),
        "page_in_j": math.fsum(spent["page_in_j"]),
        "page_out_j": math.fsum(spent["page_out_j"]),
        "runtime_s": runtime,
        "peak_ram_bytes": peak,
        "storage_bytes": storage,
        "computes": counts["compute"],
        "recomputes": counts["compute"] - len(names),
        "page_ins": counts["page_in"],
        "page_outs": counts["page_out"],
        "storage_read_bytes": read_bytes,
        "storage_written_bytes": written_bytes,
    }


def replay(doc: dict, *, source: str | None = None) -> dict:
    """Replay the steps under the rules and budgets (not the reported totals); return the recomputed totals."""
    totals = _replay(_read_plan(doc, source), source)
    _check_wear(doc, source)
    return totals


def _check_wear(doc: dict, source: str | None) -> None:
    """budgets.min_lifetime_steps: every page-out wears erase blocks (its tensor's own on raw flash,
    those its write commands touch on a wear-levelled card), and so does every update of streamed
    weights; the steps must leave the medium alive that long (docs/schedule-format.md)."""
    budgets = doc.get("budgets") if isinstance(doc.get("budgets"), dict) else {}
    want = budgets.get("min_lifetime_steps")
    if want is None:
        return
    want = int(want)  # _read_plan has checked it
    device = doc.get("device") if isinstance(doc.get("device"), dict) else {}
    block, endurance, capacity = (device.get(k) for k in ("erase_block_bytes", "endurance_cycles",
                                                          "storage_capacity_bytes"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (block, endurance, capacity)):
        raise ScheduleInvalid("budgets.min_lifetime_steps needs device.erase_block_bytes, endurance_cycles and "
                              "storage_capacity_bytes (positive integers) to be checked", source=source)
    nodes = doc["graph"]["nodes"]
    levelled = device.get("wear_levelling") is True
    # a controller that levels wear takes 512-byte sectors: a page-out is one command for the whole
    # sectors (at most ceil((W - 512) / block) + 1 blocks touched, wherever it lies) and one for a
    # partial last sector; raw flash erases the tensor's own blocks (docs/schedule-format.md)
    packed = levelled and device.get("storage_kind") not in ("spi-flash", "qspi-flash", "internal-flash")
    # a card that appends sequential writes takes a step's writes as one log from an aligned start,
    # which wears the whole units it fills (docs/wear.md)
    log = packed and device.get("write_cache") is not True and device.get("sequential_writes") is True

    def worn(nbytes: int) -> int:
        if not packed:
            return -(-nbytes // block) * block
        if device.get("write_cache") is True or log:  # gathered, or appended to the log: its sectors
            return -(-nbytes // 512) * 512
        whole = nbytes // 512 * 512
        units = (-(-max(whole - 512, 0) // block) + 1 if whole else 0) + (nbytes > whole)
        return units * block

    erased = sum(worn(int(nodes[s["node"]]["bytes"])) for s in doc["steps"] if s["op"] == "page_out")
    # an update rewrites the regions of the weights it changes, once each per step: on a packed card
    # each weights node is written back as a page-out is; otherwise a wear-levelling controller
    # keeps a layer's slices (names up to "#") in one region, raw flash each in its own
    # (_read_plan has checked the ids)
    updated = {p for s in doc["steps"] if s["op"] == "compute" for p in nodes[s["node"]].get("updates", ())}
    if packed:
        erased += sum(worn(int(nodes[p]["bytes"])) for p in updated)
    else:
        region: dict = {}
        for n, node in enumerate(nodes):
            if node.get("op") == "param":
                key = str(node["name"]).split("#", 1)[0] if levelled else n
                region[key] = region.get(key, 0) + int(node["bytes"])
        rewritten = {str(nodes[p]["name"]).split("#", 1)[0] if levelled else p for p in updated}
        erased += sum(-(-region[k] // block) * block for k in rewritten if k in region)
    if not erased:
        return
    if log:
        erased = -(-erased // block) * block
    lifetime = endurance * capacity // erased if device.get("wear_levelling") is True else endurance
    if lifetime < want:
        raise ScheduleInvalid(f"the page-outs erase {_b(erased)} per step: the storage lasts {lifetime:,} training "
                              f"steps, fewer than budgets.min_lifetime_steps {want:,}", source=source)


def validate(doc: dict, *, source: str | None = None) -> dict:
    """Check everything the format promises; return the recomputed totals, or raise on the first violation."""
    plan = _read_plan(doc, source)
    reported, memory = _read_reported(doc, source)
    totals = _replay(plan, source)
    _check_wear(doc, source)  # a file's wear budget holds as its steps wear, as the solver's replay checks
    for key, integer in TOTAL_KEYS.items():
        got, want = reported[key], totals[key]
        if integer and got != want:
            raise ScheduleInvalid(f"totals.{key} is {got:,} but the steps give {want:,}", source=source)
        if not integer and not math.isclose(got, want, rel_tol=REL_TOL, abs_tol=ABS_TOL):
            raise ScheduleInvalid(f"totals.{key} is {got:.12g} but the steps add up to {want:.12g}", source=source)
    for key in TRAFFIC_KEYS:
        got = doc["totals"].get(key)
        if got is not None and _number(got, f"totals.{key}", source, integer=True) != totals[key]:
            raise ScheduleInvalid(f"totals.{key} is {got:,} but the steps give {totals[key]:,}", source=source)
    if memory is not None:
        if memory["working_peak_bytes"] != totals["peak_ram_bytes"]:
            raise ScheduleInvalid(f"memory.working_peak_bytes is {_b(memory['working_peak_bytes'])} but the "
                                  f"replayed peak RAM is {_b(totals['peak_ram_bytes'])}", source=source)
        want = memory["param_bytes"] + memory["param_grad_bytes"] + memory["working_peak_bytes"]
        if memory["total_bytes"] != want:
            raise ScheduleInvalid(f"memory.total_bytes is {_b(memory['total_bytes'])} but param_bytes + "
                                  f"param_grad_bytes + working_peak_bytes = {_b(want)}", source=source)
    return totals


def load_and_validate(path) -> tuple[dict, dict]:
    """Read a schedule file and validate it; return (document, recomputed totals)."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PoetError(f"cannot read the schedule: {exc.strerror or exc}", source=source) from None
    except UnicodeDecodeError:
        raise PoetError("not a schedule: the file is not UTF-8 text", source=source) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PoetError(f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}", source=source) from None
    except RecursionError:
        raise PoetError("not valid JSON for a schedule: nested too deeply", source=source) from None
    except ValueError as exc:  # Python refuses integers of over 4300 digits
        raise PoetError(f"not a schedule: {str(exc).split(';')[0]}", source=source) from None
    return doc, validate(doc, source=source)
