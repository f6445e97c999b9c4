"""Measured per-layer costs: a CSV or YAML file of the user's own profiling overrides the FLOP model.

Each row names a node (``layer4.1.conv2``, ``grad:fc``, ``update:fc``) or an operator type
(``conv2d``, ``conv2d_grad``, ``relu``, ``adam_update``) and gives ``time_s`` and/or ``energy_j`` for one
run of that node. A node takes its own row if it has one, else its operator type's row; a row with only
a time costs its energy at the device's active power, a row with only an energy keeps the FLOP-model
time. Names that match nothing are an error listing the close ones, so a typo never silently falls
back to FLOP counts. How to produce the file on a board: docs/importers.md.

CSV::

    name,time_s,energy_j
    layer4.1.conv2,0.0123,
    relu,0.0002,0.00001

YAML: a mapping ``name: {time_s: ..., energy_j: ...}`` or a list of such rows with a ``name`` key.
"""

from __future__ import annotations

import csv
import difflib
import io
import math
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from poet_opt.errors import PoetError, shown
from poet_opt.files import YAMLLimitError, load_yaml
from poet_opt.model.graph import TrainingGraph
from poet_opt.units import MAX_JOULES, MAX_SECONDS

FIELD = "--costs"
COLUMNS = ("time_s", "energy_j")
LIMITS = {"time_s": (MAX_SECONDS, "s"), "energy_j": (MAX_JOULES, "J")}


@dataclass(frozen=True)
class MeasuredCosts:
    source: str
    rows: dict[str, dict[str, float]]  # name or op type -> {"time_s": ..., "energy_j": ...}

    def names(self) -> frozenset[str]:
        return frozenset(self.rows)


def load_costs(path) -> MeasuredCosts:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PoetError("no such cost file", source=source, field=FIELD) from None
    except IsADirectoryError:
        raise PoetError("is a directory, not a cost file", source=source, field=FIELD) from None
    except UnicodeDecodeError:
        raise PoetError("not a cost file: the file is not UTF-8 text", source=source, field=FIELD) from None
    except OSError as exc:
        raise PoetError(f"cannot read the file: {exc.strerror}", source=source, field=FIELD) from None
    suffix = Path(source).suffix.lower()
    if suffix == ".csv":
        raw = _csv_rows(text, source)
    elif suffix in (".yaml", ".yml"):
        raw = _yaml_rows(text, source)
    else:
        raise PoetError("give a .csv, .yaml or .yml file", source=source, field=FIELD)
    rows: dict[str, dict[str, float]] = {}
    for where, name, values in raw:
        if not name:
            raise PoetError("missing (a node name or an operator type)", source=source, field=f"{where}.name")
        if name in rows:
            raise PoetError(f"{name!r} is given twice", source=source, field=f"{where}.name")
        unknown = set(values) - set(COLUMNS)
        if unknown:
            first = shown(sorted(map(str, unknown))[0])
            raise PoetError(f"unknown column {first}; columns are name, {', '.join(COLUMNS)}", source=source,
                            field=where)
        parsed = {}
        for key in COLUMNS:
            value = values.get(key)
            if value is None or value == "":
                continue
            number = _number(value)
            if number is None or not math.isfinite(number) or number < 0:
                raise PoetError(f"must be a finite number >= 0 (SI units), got {shown(value)}", source=source,
                                field=f"{where}.{key}")
            most, unit = LIMITS[key]
            if number > most:
                raise PoetError(f"must be at most {most:g} {unit}, got {shown(value)}", source=source,
                                field=f"{where}.{key}")
            parsed[key] = number
        if not parsed:
            raise PoetError(f"{name!r} gives neither time_s nor energy_j", source=source, field=where)
        rows[name] = parsed
    if not rows:
        raise PoetError("the cost file has no rows", source=source, field=FIELD)
    return MeasuredCosts(source, rows)


def _number(value):
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
        return None


def _csv_rows(text: str, source: str):
    reader = csv.DictReader(io.StringIO(text))
    if not reader.fieldnames or "name" not in [f.strip() for f in reader.fieldnames]:
        raise PoetError("the first line must be a header with a 'name' column (name,time_s,energy_j)",
                        source=source, field="line 1")
    out = []
    for k, row in enumerate(reader, start=2):
        if None in row:
            raise PoetError("more values than header columns", source=source, field=f"line {k}")
        row = {str(key).strip(): (v or "").strip() for key, v in row.items()}
        name = row.pop("name")
        if not name and not any(row.values()):
            continue  # blank line
        out.append((f"line {k}", name, row))
    return out


def _yaml_rows(text: str, source: str):
    try:
        doc = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        what = "refused" if isinstance(exc, YAMLLimitError) else "not valid YAML"
        raise PoetError(f"{what}: {getattr(exc, 'problem', None) or exc}", source=source, field=where) from None
    out = []
    if isinstance(doc, dict):
        for name, values in doc.items():
            if not isinstance(values, dict):
                raise PoetError(f"expected time_s and/or energy_j under it, got {shown(values)}", source=source,
                                field=str(name))
            out.append((str(name), str(name), values))
    elif isinstance(doc, list):
        for k, item in enumerate(doc):
            if not isinstance(item, dict):
                raise PoetError("expected a mapping with name, time_s, energy_j", source=source, field=f"[{k}]")
            values = dict(item)
            out.append((f"[{k}]", str(values.pop("name", "") or ""), values))
    else:
        raise PoetError("expected a mapping of names to {time_s, energy_j} or a list of rows", source=source,
                        field="(top level)")
    return out


def apply_costs(graph: TrainingGraph, costs: MeasuredCosts) -> TrainingGraph:
    """The graph with measured times/energies on every node its file covers (by name, else by op)."""
    names = {n.name for n in graph.nodes}
    ops = {n.op for n in graph.nodes if n.op}
    for key in costs.rows:
        if key not in names and key not in ops:
            close = difflib.get_close_matches(key, sorted(names | ops), n=4, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else \
                f"; operator types here: {', '.join(sorted(ops))}"
            raise PoetError(f"{key!r} is neither a node nor an operator type of {graph.name}{hint}",
                            source=costs.source, field=FIELD)
    nodes = []
    for node in graph.nodes:
        row = costs.rows.get(node.name) or costs.rows.get(node.op)
        if row is None:
            nodes.append(node)
            continue
        nodes.append(replace(node, compute_s=row.get("time_s", node.compute_s),
                             compute_j=row.get("energy_j", node.compute_j)))
    covered = sum(1 for a, b in zip(graph.nodes, nodes) if a is not b)
    meta = {**graph.meta, "measured_costs": costs.source, "measured_nodes": covered}
    return TrainingGraph(graph.name, tuple(nodes), meta)
