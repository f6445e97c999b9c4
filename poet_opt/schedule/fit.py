"""Does a plan run on its device? Weights, their gradients, optimizer state, the working peak (or a
firmware arena) and the stack reserve against the device's RAM; streamed weights and paged tensors
against its storage. The checks the commands run before and after a solve, as plain functions."""

from __future__ import annotations

from poet_opt.device.media import packs_sectors, wear_levelled
from poet_opt.errors import PoetError
from poet_opt.schedule.decisions import stored_param_bytes
from poet_opt.units import format_bytes, parse_size


def check_ram_within_device(ram, profile) -> None:
    budget = parse_size(ram, field="--ram")
    if budget > profile.memory.ram_bytes:
        raise PoetError(f"{format_bytes(budget)} is more than {profile.name}'s {format_bytes(profile.memory.ram_bytes)} "
                        "of RAM", field="--ram")


def check_weights_stored(graph, profile) -> None:
    """Streamed weights and optimizer state must fit the device's storage."""
    stored = stored_param_bytes(graph, profile.storage)
    if stored > profile.storage.capacity_bytes:
        if packs_sectors(profile.storage.kind, wear_levelled(profile.storage)):
            how = "each tensor in whole 512-byte sectors"
        else:
            unit = "layer's" if wear_levelled(profile.storage) else "slice's"
            how = f"each {unit} in whole erase blocks of {format_bytes(profile.storage.erase_block_bytes)}"
        raise PoetError(f"the weights and optimizer state of {graph.name} take {format_bytes(stored)} on storage "
                        f"({how}), "
                        f"more than {profile.name}'s {format_bytes(profile.storage.capacity_bytes)} "
                        f"{profile.storage.kind}", field="--weights")


def check_weights_fit(graph, profile) -> None:
    """Before a long solve: when the weights do not fit the storage, or the weights, their gradients,
    the stack reserve and the smallest working set any schedule needs already exceed the RAM, no
    plan can run on the device. (Streamed weights are part of that working set: param_bytes counts
    only resident ones.)"""
    check_weights_stored(graph, profile)
    need = (graph.param_bytes + graph.param_grad_bytes + profile.memory.stack_reserve_bytes
            + graph.min_working_set_bytes())
    if need > profile.memory.ram_bytes and graph.streams_weights:
        working, node = graph.largest_working_set()
        raise PoetError(f"no plan can run on {profile.name}: computing {node.name} holds its inputs, weights and output, "
                        f"{format_bytes(working)}, at once; with the stack reserve "
                        f"{format_bytes(profile.memory.stack_reserve_bytes)} that is more than its "
                        f"{format_bytes(profile.memory.ram_bytes)} (weights are sliced to fit, {_strips_note(graph)}); "
                        "train a smaller model or plan anyway with --allow-oversize", field="--device")
    if need > profile.memory.ram_bytes:
        raise PoetError(f"no plan can run on {profile.name}: weights {format_bytes(graph.param_bytes)}, gradients "
                        f"{format_bytes(graph.param_grad_bytes)}, stack reserve "
                        f"{format_bytes(profile.memory.stack_reserve_bytes)} and the smallest working set "
                        f"{format_bytes(graph.min_working_set_bytes())} need {format_bytes(need)} of its "
                        f"{format_bytes(profile.memory.ram_bytes)}; " + _streaming_hint(graph)
                        + "train fewer layers (--trainable), or plan anyway with --allow-oversize", field="--device")


def _streaming_hint(graph) -> str:
    tried = graph.meta.get("streamed_working_set")
    if tried:  # --weights auto tried it
        return (f"streamed weights would not fit either (computing {tried['node']} holds "
                f"{format_bytes(tried['bytes'])} at once, {_strips_note(graph)}); ")
    return "stream the weights from storage (--weights streamed), " if graph.param_bytes else ""


def _strips_note(graph) -> str:
    """What activation strips (model/strips.py) did about the node that does not fit."""
    strips = graph.meta.get("strips")
    if strips is not None and strips.tensors:
        return "even with its activations in strips"
    transformer = any(n.op == "matmul" for n in graph.nodes)
    if graph.meta.get("strips_tried"):
        return ("and no row tiling of its tokens brings every node within it" if transformer else
                "and no number of activation strips brings every node within it")
    if transformer:
        return "and activations are whole: --strips tiles a transformer's tokens into row blocks"
    return "and activations are whole: --strips splits a zoo CNN's into strips"


def check_fits_device(schedule, firmware) -> None:
    """A plan that cannot run on the device is not an answer: say by how much it misses."""
    mem = schedule.memory()
    working = firmware.arena.arena_bytes if firmware is not None else mem["working_peak_bytes"]
    fit = fit_of(mem, mem["device_ram_bytes"], working)
    if not fit["fits"]:
        raise PoetError(f"the plan needs {format_bytes(fit['needed_bytes'])} on {schedule.profile.name}, which has "
                        f"{format_bytes(mem['device_ram_bytes'])}: weights {format_bytes(mem['param_bytes'])}, "
                        f"gradients {format_bytes(mem['param_grad_bytes'])}, "
                        f"{'arena' if firmware is not None else 'working peak'} {format_bytes(working)}, stack reserve "
                        f"{format_bytes(mem['stack_reserve_bytes'])}; train fewer layers (--trainable), give a smaller "
                        "--ram, or keep it anyway with --allow-oversize", field="--ram")
    if not mem["fits_storage"]:
        raise PoetError(f"the plan stores {format_bytes(mem['stored_bytes'])} (paged tensors and streamed weights), "
                        f"more than {schedule.profile.name}'s {format_bytes(mem['storage_capacity_bytes'])} of storage",
                        field="--ram")


def device_fit(doc: dict, working_bytes: int) -> dict | None:
    """The device fit of a schedule file, from its own figures (None when it has no device RAM)."""
    ram = (doc.get("device") or {}).get("ram_bytes")
    if not isinstance(ram, int) or isinstance(ram, bool):
        return None
    return fit_of(doc.get("memory") or {}, ram, working_bytes)


def fit_of(memory: dict, device_ram: int, working_bytes: int) -> dict:
    """Weights, their gradients, the stack reserve and the working memory (live peak or arena)
    against the device's RAM; schedule files from before the stack reserve count none."""
    need = sum(int(memory.get(k) or 0) for k in ("param_bytes", "param_grad_bytes", "stack_reserve_bytes"))
    need += int(working_bytes)
    return {"device_ram_bytes": device_ram, "needed_bytes": need, "fits": need <= device_ram}
