"""Training graphs from files: networkx node-link JSON, as in the public Checkmate/Moccasin sets.

Nodes carry ``id``, ``name``, ``backward`` (bool), ``cost_cpu`` (seconds) and ``cost_ram`` (output
bytes); ``links`` (or ``edges``) carry ``source`` and ``target``. Nothing is assumed about the ids:
they may be strings, sparse, or listed out of topological order. Plain json, no networkx.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from poet_opt.errors import PoetError, shown
from poet_opt.model.graph import Node, TrainingGraph
from poet_opt.units import MAX_BYTES, MAX_QUANTITY


def load_node_link(path) -> TrainingGraph:
    source = str(path)
    raw = _read_json(source)
    if not isinstance(raw, dict):
        raise PoetError("expected a JSON object with 'nodes' and 'links'", source=source, field="(top level)")
    raw_nodes = raw.get("nodes")
    if not isinstance(raw_nodes, list):
        problem = "missing" if raw_nodes is None else f"must be a list, got {type(raw_nodes).__name__}"
        raise PoetError(f"{problem}; a node-link graph lists its nodes there", source=source, field="nodes")
    link_key = "links" if "links" in raw else "edges"
    raw_links = raw.get(link_key)
    if not isinstance(raw_links, list):
        problem = "missing (give 'links' or 'edges')" if raw_links is None else \
            f"must be a list, got {type(raw_links).__name__}"
        raise PoetError(problem, source=source, field="links")

    def fail(message: str, field: str):
        raise PoetError(message, source=source, field=field)

    entries = []  # (original id, name, kind, bytes, compute_s, op)
    position: dict = {}
    for k, item in enumerate(raw_nodes):
        where = f"nodes[{k}]"
        if not isinstance(item, dict):
            fail(f"must be an object with id and cost_ram, got {type(item).__name__}", where)
        if "id" not in item:
            fail("missing", f"{where}.id")
        node_id = item["id"]
        if isinstance(node_id, bool) or not isinstance(node_id, (int, str)):
            fail(f"must be an integer or a string, got {shown(node_id)}", f"{where}.id")
        if node_id in position:
            fail(f"duplicate id {shown(node_id)} (also nodes[{position[node_id]}])", f"{where}.id")
        position[node_id] = k
        name = item.get("name", node_id)
        name = str(node_id) if name is None else str(name)
        if "cost_ram" not in item:
            fail(f"missing (node {shown(node_id)}: its output size in bytes)", f"{where}.cost_ram")
        size = _cost(item["cost_ram"], f"{where}.cost_ram", node_id, fail, MAX_BYTES, "2^63 - 1 bytes")
        if item.get("cost_cpu") is None:  # not 0 s: a node that costs nothing must say so
            fail(f"missing (node {shown(node_id)}: seconds to compute it)", f"{where}.cost_cpu")
        seconds = _cost(item["cost_cpu"], f"{where}.cost_cpu", node_id, fail, MAX_QUANTITY, f"{MAX_QUANTITY:.4g} s")
        backward = item.get("backward", False)
        if backward not in (True, False):  # 0 and 1 pass too
            fail(f"must be true or false, got {shown(backward)}", f"{where}.backward")
        kind = "backward" if backward else "loss" if name.lower() == "loss" else "forward"
        op = item.get("op", "")
        entries.append((node_id, name, kind, math.ceil(size), seconds, op if isinstance(op, str) else ""))

    _check_time_sums([e[4] for e in entries], fail)
    # Integer ids are kept so that messages from the graph check name the ids the user wrote.
    all_int = all(isinstance(e[0], int) for e in entries)
    key = {e[0]: (e[0] if all_int else k) for k, e in enumerate(entries)}
    deps: list[set[int]] = [set() for _ in entries]
    for k, link in enumerate(raw_links):
        where = f"{link_key}[{k}]"
        if not isinstance(link, dict):
            fail(f"must be an object with source and target, got {type(link).__name__}", where)
        ends = []
        for end in ("source", "target"):
            if end not in link:
                fail("missing", f"{where}.{end}")
            value = link[end]
            if isinstance(value, bool) or not isinstance(value, (int, str)) or value not in position:
                fail(f"refers to node {shown(value)}, which is not in nodes", f"{where}.{end}")
            ends.append(value)
        src, dst = ends
        if src == dst:
            fail(f"is a self-loop on node {shown(src)}", where)
        deps[position[dst]].add(key[src])

    nodes = [Node(id=key[e[0]], name=e[1], kind=e[2], bytes=e[3], deps=tuple(sorted(d)), op=e[5], compute_s=e[4])
             for e, d in zip(entries, deps)]
    graph_info = raw.get("graph")
    name = graph_info.get("name") if isinstance(graph_info, dict) else None
    name = str(name) if name else Path(source).stem
    return TrainingGraph.build(name, nodes, source=source, meta={"source": source, "format": "node-link"},
                               given_ids={key[e[0]]: e[0] for e in entries})


def _check_time_sums(seconds: list[float], fail) -> None:
    """Costs come in any unit: any time is taken as long as every sum the solver and the schedule
    form stays within MAX_QUANTITY: a plan may run each of the n nodes up to n times, so n times
    the total."""
    n = len(seconds)
    total = math.fsum(seconds)
    if total * max(n, 1) <= MAX_QUANTITY:
        return
    k = max(range(n), key=lambda i: seconds[i])
    fail(f"the nodes' times, each run up to {n} times, add up past what the solver can sum: all together "
         f"at most {MAX_QUANTITY / n:.4g} s, got {shown(seconds[k])} here among {shown(total)} in all",
         f"nodes[{k}].cost_cpu")


def _read_json(source: str):
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PoetError("no such graph file", source=source, field="path") from None
    except IsADirectoryError:
        raise PoetError("is a directory, not a graph file", source=source, field="path") from None
    except UnicodeDecodeError:
        raise PoetError("not JSON: the file is not UTF-8 text", source=source, field="(file)") from None
    except OSError as exc:
        raise PoetError(f"cannot read the file: {exc.strerror}", source=source, field="path") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PoetError(f"not valid JSON: {exc.msg}", source=source,
                        field=f"line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise PoetError("not valid JSON: nested too deeply", source=source, field="(file)") from None
    except ValueError as exc:  # Python refuses integers of over 4300 digits
        raise PoetError(f"not a graph: {str(exc).split(';')[0]}", source=source, field="(file)") from None


def _cost(value, field: str, node_id, fail, most, most_text: str) -> float:
    # Compared as given (an int may have 400 digits, too large for a float), before any arithmetic.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        fail(f"must be a finite number, got {shown(value)} (node {shown(node_id)})", field)
    if value < 0:
        fail(f"must be >= 0, got {shown(value)} (node {shown(node_id)})", field)
    if value > most:
        fail(f"must be at most {most_text}, got {shown(value)} (node {shown(node_id)})", field)
    return value
