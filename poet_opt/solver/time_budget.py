"""How much of a time limit a solve keeps for its last step: replaying the chosen plan into steps,
validating and summarising it, which no solver phase may eat into, and which on a very large
graph can exceed a short limit by itself (then refused at once, naming a limit that would do)."""

from __future__ import annotations

import math
import time
from typing import Optional

from poet_opt.model.graph import TrainingGraph
from poet_opt.errors import NoScheduleFound, PoetError

# What `solve`, `run`, `emulate` and `pareto` (per point) give the solver when --time-limit is not
# given: one default, so the same model and budget get the same plan from every command. A minute
# proves the plans of graphs up to a few thousand nodes; past that the best plan found stands, with
# its proven gap (ResNet-18 at 200 KiB on the nRF52840 ran past 17 minutes without a limit).
DEFAULT_TIME_LIMIT_S = 60.0

# Replaying the chosen plan into steps, validating and summarising it, once every solver phase is
# over: linear in the graph (about 2 s at 100,000 nodes on a quiet core, 5 s on a busy one); the
# phases leave this much for it. On a large graph it is measured instead: FINISH_PASSES times one
# plain-training pass over the graph, timed at the start of the solve (the same kind of Python
# loop, so the ratio holds on a slow or busy machine too: 14 measured at 100,000 nodes).
FINISH_S_PER_NODE = 6e-5
FINISH_PASSES = 16
# ... and the passes every solve makes before its first phase can give up (costs, working sets,
# the execution orders' first sweep): measured 4 passes
SETUP_PASSES = 4
FINISH_MEASURED_FROM_NODES = 10_000
_pass_s_per_node = [0.0]  # the last measured, on this machine as busy as it was then


def finish_s(graph: TrainingGraph) -> float:
    return len(graph) * max(FINISH_S_PER_NODE, FINISH_PASSES * _pass_s_per_node[0])


def check_time_limit_fits(graph: TrainingGraph, time_limit: Optional[float]) -> None:
    """A plan of a very large graph takes longer to replay and validate than a short limit allows
    (a minute at 10^6 nodes on a busy machine): refused at once, naming the limit that would do,
    rather than a solve that runs on past the limit it promised to keep."""
    _pass_s_per_node[0] = 0.0
    if time_limit is None or len(graph) < FINISH_MEASURED_FROM_NODES:
        return
    started = time.perf_counter()
    graph.plain_peak_bytes()
    _pass_s_per_node[0] = (time.perf_counter() - started) / len(graph)
    finish = finish_s(graph)
    if finish + SETUP_PASSES * _pass_s_per_node[0] * len(graph) > time_limit:
        raise NoScheduleFound(f"a plan of this {len(graph):,}-node graph takes about {finish:.0f} s on this machine "
                              f"to replay, validate and report once found, more than the {time_limit:g} s limit; "
                              f"give --time-limit {math.ceil(2 * finish)} or more", field="--time-limit")


def parse_time_limit(text, *, field: str = "--time-limit") -> Optional[float]:
    """A command's --time-limit: not given (None), the shared default; ``none``, no limit (wait for
    the proof); else seconds, positive and finite."""
    if text is None:
        return DEFAULT_TIME_LIMIT_S
    if isinstance(text, str) and text.strip().lower() == "none":
        return None
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        raise PoetError(f"expected seconds or none, got {text!r}", field=field) from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise PoetError(f"expected a positive number of seconds (or none), got {text!r}", field=field)
    return seconds
