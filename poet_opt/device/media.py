"""How a storage medium holds and wears the tensors a plan pages out.

Raw flash (SPI, QSPI, a part's internal flash) has no controller between the firmware and the
cells: a region must be erased before it is written again, a whole erase block at a time, so every
paged tensor gets erase blocks of its own and its page-out erases them.

A block device with a flash translation layer (SD cards, eMMC, SSDs, USB sticks) takes writes of
512-byte sectors and places them itself. Paged tensors are then packed sector by sector: a
tensor of a few KiB occupies a few KiB, not a whole 4 MiB allocation unit. What a write wears is
another matter. A card without a write cache commits each write command on its own, and its
controller may rewrite every allocation unit (AU) the command touches: the emulated card of
firmware/storage_model.py counts exactly that. The firmware pages a tensor out in at most two
commands, its whole sectors and then its last partial sector through a bounce buffer
(board/poet_paging.c); W whole-sector bytes at a sector-aligned offset touch at most
ceil((W - 512) / AU) + 1 units. Wear is counted at that worst case, occupancy in sectors.
Behind a write cache (``write_cache: true``: Linux's page cache on a Raspberry Pi) the writes reach
the card gathered into long sequential runs, and the units worn are the sectors written.

A card that appends sequential writes (``sequential_writes: true``, docs/wear.md: the SD spec's
Speed Class model, where a host filling an AU in order costs the card one new AU) is written as a
log: each step's page-outs and weight write-backs, in step order, sector after sector from an
AU-aligned start (firmware/arena.py lays it out so). A write that continues the previous one
inside an AU wears nothing more; one that starts anywhere else makes the card rewrite that AU.
``au_rewrites`` is that rule, which the emulated card applies to every command; the log of a step
that writes R bytes of sectors then wears exactly ceil(R / AU) units.
"""

from __future__ import annotations

import math

import numpy as np

SECTOR_BYTES = 512  # the logical block of SD cards, eMMC, SSDs and USB sticks
RAW_FLASH_KINDS = ("spi-flash", "qspi-flash", "internal-flash")


def wear_levelled(storage) -> bool:
    """Whether the medium spreads erases over its whole capacity (a flash translation layer: SD
    cards, eMMC, SSDs, USB sticks) or erases exactly the blocks written (raw NOR flash), unless the
    profile says otherwise."""
    if storage.wear_levelling is not None:
        return bool(storage.wear_levelling)
    return storage.kind not in RAW_FLASH_KINDS


def packs_sectors(kind: str, levelled: bool) -> bool:
    """Whether paged tensors share allocation units: only where a controller places sectors and
    spreads the wear. Without wear levelling a unit shared by k tensors would wear k times per
    step, so each tensor keeps units of its own."""
    return levelled and kind not in RAW_FLASH_KINDS


def occupied_bytes(nbytes, kind: str, levelled: bool, erase_block: int) -> np.ndarray:
    """Storage a paged copy of each tensor occupies: whole sectors where they are packed, whole
    erase blocks otherwise."""
    unit = SECTOR_BYTES if packs_sectors(kind, levelled) else erase_block
    return np.ceil(np.asarray(nbytes, dtype=float) / unit) * unit


def logs_sequentially(kind: str, levelled: bool, write_cache: bool, sequential_writes: bool) -> bool:
    """Whether a step's writes go to the card as one sequential log (see the module docstring): a
    packed card that appends sequential writes, without a write cache (which gathers them anyway)."""
    return packs_sectors(kind, levelled) and not write_cache and sequential_writes


def erased_bytes(nbytes, kind: str, levelled: bool, erase_block: int, write_cache: bool = False,
                 sequential: bool = False) -> np.ndarray:
    """Bytes of erase blocks that writing each tensor once wears, at worst: its own erase blocks
    on raw flash, every allocation unit a sector-aligned write of it can touch on a packed medium,
    its sectors where a write cache gathers the writes or the step's log appends them (the log's
    last, partly filled unit is ``step_erased_bytes``'s)."""
    nbytes = np.asarray(nbytes, dtype=float)
    if not packs_sectors(kind, levelled):
        return np.ceil(nbytes / erase_block) * erase_block
    if write_cache or sequential:
        return np.ceil(nbytes / SECTOR_BYTES) * SECTOR_BYTES
    whole = np.floor(nbytes / SECTOR_BYTES) * SECTOR_BYTES
    units = np.where(whole > 0, np.ceil(np.maximum(whole - SECTOR_BYTES, 0.0) / erase_block) + 1, 0.0)
    units += (nbytes > whole)  # the partial last sector, a command of its own
    return units * erase_block


def storage_occupied(nbytes, storage) -> np.ndarray:
    return occupied_bytes(nbytes, storage.kind, wear_levelled(storage), storage.erase_block_bytes)


def storage_logs(storage) -> bool:
    return logs_sequentially(storage.kind, wear_levelled(storage), bool(storage.write_cache),
                             bool(storage.sequential_writes))


def storage_erased(nbytes, storage) -> np.ndarray:
    return erased_bytes(nbytes, storage.kind, wear_levelled(storage), storage.erase_block_bytes,
                        bool(storage.write_cache), storage_logs(storage))


def step_erased_bytes(summed: float, erase_block: int, sequential: bool) -> int:
    """The wear of a step whose writes wear ``summed`` bytes by ``erased_bytes``: that sum, or on a
    sequential log the whole units its sectors fill from an aligned start."""
    summed = int(math.ceil(summed))
    return -(-summed // erase_block) * erase_block if sequential else summed


def log_allowance(erased_cap: float, erase_block: int, sequential: bool) -> float:
    """The most sector bytes a step's log may write and wear at most ``erased_cap``: whole units
    (ceil(R / AU) * AU <= cap exactly when R <= floor(cap / AU) * AU)."""
    return float(erased_cap // erase_block * erase_block) if sequential else float(erased_cap)


def au_rewrites(offset: int, length: int, erase_block: int, open_unit: tuple | None) -> tuple[int, tuple | None]:
    """The card's rule for one write command of whole sectors on a sequential card: the units it
    makes the card rewrite, and the unit left open for appending, as (unit, next offset). The card
    keeps one unit open, the fewest the SD spec's model needs: a write that starts at the open
    unit's next offset is appended; every other unit the command reaches is rewritten once."""
    worn, at, end = 0, offset, offset + length
    while at < end:
        unit = at // erase_block
        upto = min(end, (unit + 1) * erase_block)
        if open_unit != (unit, at):
            worn += 1
        open_unit = (unit, upto)
        at = upto
    return worn, open_unit
