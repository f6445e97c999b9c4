"""The one walk of a schedule's steps, which the validator and every backend follow.

A schedule is a list of steps (compute, page_out, page_in, free) over the nodes of a training
graph (docs/schedule-format.md has the rules). What each step means for the tensors in RAM and on
storage, which computes are a node's first and which recompute it, and which orders no backend can
reproduce (a tensor read before it is in RAM, weights read after a node updated them in place) is
decided here once. The validator (schedule/validator.py) walks a document with it and adds the
budgets and totals; the firmware generator (firmware/writer.py) and the PyTorch executors
(executor/runner.py, executor/tiled.py, executor/strips.py) walk the same steps and only say what
a step does in C or in torch. So a schedule the validator accepts is the schedule they run, step
for step, and one they would refuse is refused by all of them with the same line.

The walk shares no code with the graph, the cost model or the solver: what it checks cannot be
vouched for by the code that produced the plan.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple, Sequence

from poet_opt.errors import PoetError

OPS = ("compute", "page_out", "page_in", "free")


class ScheduleInvalid(PoetError):
    """A well-formed schedule that breaks a replay rule, a budget, or its own reported totals."""

    exit_code = 1


class Step(NamedTuple):
    """One step as it runs: ``index`` in the schedule's steps, ``op`` one of OPS, ``node`` its id.
    ``first``: for a compute, the node's first in the training step (False: a recompute); for a
    page-out, the node's first copy on storage (False: it rewrites the copy it already has)."""

    index: int
    op: str
    node: int
    first: bool


def walk(steps: Iterable[tuple[str, int]], deps: Sequence[Sequence[int]], updates: Sequence[Sequence[int]],
         names: Sequence[str], *, source: str | None = None, complete: bool = True) -> Iterator[Step]:
    """The steps of a schedule, each checked against the replay rules before it is yielded.

    ``steps`` are (op, node id) pairs; ``deps[n]`` the nodes node n reads, ``updates[n]`` the
    weights it changes in place (among its deps), ``names[n]`` its name for messages. Raises
    ScheduleInvalid (naming the step) at the first step no backend can run; with ``complete``,
    also if the walk ends with a node never computed (a prefix of a schedule is walked with
    ``complete=False``)."""
    resident: set[int] = set()
    stored: set[int] = set()
    computed = [False] * len(names)
    updated_by: dict[int, int] = {}  # weights changed in place -> the node that changed them
    for k, (op, n) in enumerate(steps):
        def invalid(what: str) -> ScheduleInvalid:
            return ScheduleInvalid(f"step {k} ({op} node {n} {shown(names[n])}): {what}", source=source)

        if op == "compute":
            for d in deps[n]:
                if d not in resident:
                    raise invalid(f"input {d} {shown(names[d])} is not resident")
            if n in resident:
                raise invalid("the node is already resident; free it before computing it again")
            for p in (n, *deps[n]):
                if p in updated_by:  # the updating node itself included: it read the old weights once
                    u = updated_by[p]
                    raise invalid(f"it reads the weights {p} {shown(names[p])} after node {u} {shown(names[u])} "
                                  "updated them in place")
            first = not computed[n]
            computed[n] = True
            for p in updates[n]:
                updated_by[p] = n
            resident.add(n)
        elif op == "page_in":
            if n not in stored:
                raise invalid("the node is not on storage (it was never paged out)")
            if n in resident:
                raise invalid("the node is already resident")
            first = False
            resident.add(n)
        elif op in ("page_out", "free"):
            if n not in resident:
                raise invalid("the node is not resident")
            first = op == "page_out" and n not in stored
            if op == "page_out":
                stored.add(n)
            else:
                resident.discard(n)
        else:
            raise invalid(f"unknown op; expected one of {', '.join(OPS)}")
        yield Step(k, op, n, first)
    if complete:
        for n, done in enumerate(computed):
            if not done:
                raise ScheduleInvalid(f"node {n} {shown(names[n])} is never computed", source=source)


def walk_document(doc: dict, *, upto: int | None = None, source: str | None = None) -> Iterator[Step]:
    """:func:`walk` over a schedule document (docs/schedule-format.md) the validator has read, or
    over its first ``upto`` steps."""
    nodes = doc["graph"]["nodes"]
    steps = doc["steps"] if upto is None else doc["steps"][:upto]
    return walk(((s["op"], int(s["node"])) for s in steps), [n["deps"] for n in nodes],
                [n.get("updates", ()) for n in nodes], [n["name"] for n in nodes], source=source,
                complete=upto is None)


def shown(value) -> str:
    """A value from a schedule, quoted short enough for a one-line message."""
    if isinstance(value, int) and abs(value) >= 10**24:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "..."
