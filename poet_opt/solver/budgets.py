"""Budgets from what the user gave (sizes, runtimes, a wear budget) and what the device has."""

from __future__ import annotations

import math
from typing import Optional

from poet_opt.device.costs import NodeCosts
from poet_opt.device.media import log_allowance, storage_logs
from poet_opt.device.profiles import DeviceProfile
from poet_opt.errors import PoetError
from poet_opt.model.graph import TrainingGraph
from poet_opt.schedule.decisions import (Budgets, lifetime_steps, step_wear_bytes, stored_param_bytes,
                                         update_region_bytes, wear_levelled, wear_storage_cap)
from poet_opt.units import format_bytes, format_seconds, parse_runtime, parse_size


def resolve_budgets(graph: TrainingGraph, profile: DeviceProfile, costs: NodeCosts,
                    ram, runtime=None, min_lifetime_steps: Optional[int] = None) -> Budgets:
    """ram: bytes or '1.5MB'; runtime: seconds, '2.5s', '1.2x' (of plain training), or None for
    unlimited; min_lifetime_steps: training steps the storage must survive (a wear budget, which
    caps the erase-block-aligned bytes paged out per step)."""
    ram_bytes = parse_size(ram, field="--ram")
    plain_s = costs.plain_runtime_s
    if runtime is None:
        runtime_s = math.inf
    else:
        runtime_s = parse_runtime(runtime, plain_s, field="--runtime")
        if runtime_s < plain_s * (1 - 1e-9):
            raise PoetError(
                f"the runtime budget {format_seconds(runtime_s)} is below plain training on this device "
                f"({format_seconds(plain_s)}); every node must run at least once, so give at least 1x",
                field="--runtime")
    capacity = profile.storage.capacity_bytes
    # streamed weights and optimizer state live on storage for good; paging gets the rest
    weights = stored_param_bytes(graph, profile.storage)
    if weights > capacity:
        raise PoetError(f"the weights and optimizer state of {graph.name} ({format_bytes(weights)}) do not fit "
                        f"{profile.name}'s {profile.storage.kind} ({format_bytes(capacity)}); stream them from a "
                        "device with more storage, or train a smaller model", field="--weights")
    storage, erase = float(capacity - weights), math.inf
    if min_lifetime_steps is not None:
        if isinstance(min_lifetime_steps, bool) or not isinstance(min_lifetime_steps, int) or min_lifetime_steps < 1:
            raise PoetError(f"must be a positive whole number of training steps, got {min_lifetime_steps!r}",
                            field="--min-lifetime-steps")
        # the updates rewrite the weights every step whatever the plan: paging gets what wear is left
        # a sequential log wears whole units: its sectors get the whole units the cap holds
        cap = log_allowance(wear_storage_cap(profile.storage, min_lifetime_steps),
                            profile.storage.erase_block_bytes, storage_logs(profile.storage))
        updates = update_region_bytes(graph, profile.storage)
        if updates and (cap < updates if wear_levelled(profile.storage)
                        else profile.storage.endurance_cycles < min_lifetime_steps):
            raise PoetError(f"updating the streamed weights rewrites {format_bytes(updates)} per step: "
                            f"{profile.name}'s storage lasts "
                            f"{lifetime_steps(profile.storage, step_wear_bytes(profile.storage, updates)):,} steps, "
                            f"fewer than {min_lifetime_steps:,}", field="--min-lifetime-steps")
        if wear_levelled(profile.storage):
            erase = cap - updates  # a row of its own: page-outs may wear more than they occupy
        else:
            storage = min(storage, cap)
    return Budgets(ram_bytes=ram_bytes, runtime_s=runtime_s, storage_bytes=storage,
                   min_lifetime_steps=min_lifetime_steps, erase_bytes=erase)
