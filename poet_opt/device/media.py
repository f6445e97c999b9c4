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
"""

from __future__ import annotations

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


def erased_bytes(nbytes, kind: str, levelled: bool, erase_block: int, write_cache: bool = False) -> np.ndarray:
    """Bytes of erase blocks that writing each tensor once wears, at worst: its own erase blocks
    on raw flash, every allocation unit a sector-aligned write of it can touch on a packed medium,
    its sectors where a write cache gathers the writes."""
    nbytes = np.asarray(nbytes, dtype=float)
    if not packs_sectors(kind, levelled):
        return np.ceil(nbytes / erase_block) * erase_block
    if write_cache:
        return np.ceil(nbytes / SECTOR_BYTES) * SECTOR_BYTES
    whole = np.floor(nbytes / SECTOR_BYTES) * SECTOR_BYTES
    units = np.where(whole > 0, np.ceil(np.maximum(whole - SECTOR_BYTES, 0.0) / erase_block) + 1, 0.0)
    units += (nbytes > whole)  # the partial last sector, a command of its own
    return units * erase_block


def storage_occupied(nbytes, storage) -> np.ndarray:
    return occupied_bytes(nbytes, storage.kind, wear_levelled(storage), storage.erase_block_bytes)


def storage_erased(nbytes, storage) -> np.ndarray:
    return erased_bytes(nbytes, storage.kind, wear_levelled(storage), storage.erase_block_bytes,
                        bool(storage.write_cache))
