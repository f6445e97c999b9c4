"""The emulated board's storage device: its contents and the rules of its kind, checked on every
operation the storage controller carries out, with traffic and wear counted.

* flash kinds (``spi-flash``, ``qspi-flash``, ``internal-flash``): a write (program) may only clear
  bits; one that would set a 0 bit to 1 is refused whole (nothing is written), recorded as a
  violation and returns ``POET_STORAGE_E_NOT_ERASED``. An erase resets one erase block to 0xFF and
  counts one erase of that block. A new part is fully erased. Program-page boundaries (256 bytes on
  NOR) are the driver's business and are not modelled. ``internal-flash`` is a region of the
  part's own flash reached through its flash controller, kept apart from the code flash here.
* block devices (``sd-card``, ``emmc``): reads and writes move whole, aligned 512-byte blocks (the
  port reads partial blocks through a bounce buffer; a partial or unaligned write is refused and
  recorded). No erase is needed. Wear: each write counts one wear event for every erase block
  (allocation unit) it touches, because a card without a write cache (the profiles' bare-metal
  ``write_cache: false``) commits each write command separately and its flash translation layer
  rewrites the allocation unit it falls in; this is the conservative model (a card that merges
  sequential writes wears less). A card that appends sequential writes (the profile's
  ``sequential_writes: true``, the SD spec's Speed Class model: docs/wear.md) keeps one unit open
  for appending instead (the rule of device/media.py's ``au_rewrites``): a write that starts where
  the previous one ended inside the unit it left open wears nothing more, and every other unit a
  write reaches is rewritten once. ``erase_counts`` holds these wear events for block devices.

Loading into storage from the host (``Storage.load``) models a programmer or a PC writing the card
before it goes into the board: no wear, no checks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from poet_opt.firmware.targets import BLOCK_DEVICE_BLOCK_BYTES, Target

# What the controller's STATUS register reads after an operation (poet_storage.h's POET_STORAGE_*).
STORAGE_OK = 0
STORAGE_E_RANGE = -1
STORAGE_E_ALIGN = -2
STORAGE_E_NOT_ERASED = -3
STORAGE_E_IO = -4


@dataclass(frozen=True)
class StorageViolation:
    """An operation the device would refuse (and the controller did): what, where, and which code
    issued it."""

    op: str
    offset: int
    length: int
    message: str
    pc: int | None = None  # the basic block that issued it (see emulator.Emulator._near)
    caller: int | None = None  # return address: where the driver function was called from

    def __str__(self) -> str:
        at = f" (pc 0x{self.pc:08x})" if self.pc is not None else ""
        if self.caller is not None:
            at += f" (called from 0x{self.caller:08x})"
        return f"{self.op} at offset {self.offset} length {self.length}: {self.message}{at}"


@dataclass(frozen=True)
class StorageStats:
    """Storage traffic and wear. For block devices ``erase_counts`` holds wear events per
    allocation unit (see the module docstring), for flash the erases per erase block."""

    kind: str
    bytes_read: int = 0
    bytes_written: int = 0
    read_ops: int = 0
    write_ops: int = 0
    erase_ops: int = 0
    erase_counts: Mapping[int, int] = field(default_factory=dict)
    violations: tuple[StorageViolation, ...] = ()
    # bytes programmed by the write commands starting at each offset: every command lies within one
    # stored tensor's region, so this says which tensors (streamed weights, paged activations) a run
    # wrote, also where several share an erase block (sectors packed on an SD card)
    written_at: Mapping[int, int] = field(default_factory=dict)

    @property
    def erases_total(self) -> int:
        return int(sum(self.erase_counts.values()))

    @property
    def erase_max_per_block(self) -> int:
        return int(max(self.erase_counts.values(), default=0))

    def since(self, before: StorageStats) -> StorageStats:
        """What happened between ``before``, an earlier ``stats()`` of the same storage, and these."""
        counts = Counter(self.erase_counts)
        counts.subtract(before.erase_counts)
        written = Counter(self.written_at)
        written.subtract(before.written_at)
        return StorageStats(
            self.kind, self.bytes_read - before.bytes_read, self.bytes_written - before.bytes_written,
            self.read_ops - before.read_ops, self.write_ops - before.write_ops,
            self.erase_ops - before.erase_ops, {k: v for k, v in counts.items() if v},
            self.violations[len(before.violations):], {k: v for k, v in written.items() if v})


class Storage:
    """The storage device's contents and its rules. Contents are kept sparsely, in 64 KiB numpy
    chunks created on first write, so that an 8 GB card costs only what is used."""

    CHUNK = 1 << 16

    def __init__(self, target: Target):
        self.target = target
        self.kind = target.storage_kind
        self.capacity_bytes = int(target.storage_capacity_bytes)
        self.erase_block_bytes = int(target.erase_block_bytes)
        self.erased_byte = target.erased_byte
        self._chunks: dict[int, np.ndarray] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_ops = 0
        self.write_ops = 0
        self.erase_ops = 0
        self.erase_counts: Counter[int] = Counter()
        self.written_at: Counter[int] = Counter()
        self.violations: list[StorageViolation] = []
        self._open_unit: tuple | None = None  # a sequential card's unit open for appending, and where

    # -- host side: no wear, no checks ------------------------------------------------------

    def load(self, offset: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Write ``data`` at ``offset`` as a programmer (or a PC, for a card) would before the part
        goes into the board: not counted, not checked against the device's write rules."""
        buf = np.frombuffer(memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray)
                                       else data).cast("B"), dtype=np.uint8)
        self._check_host_range(offset, buf.size)
        self._put(offset, buf)

    def dump(self, offset: int, nbytes: int) -> bytes:
        """The stored bytes at ``offset`` (host side, not counted)."""
        self._check_host_range(offset, nbytes)
        return self._get(offset, nbytes).tobytes()

    def stats(self) -> StorageStats:
        """Counters since this Storage was created (a run's own are in ``RunResult.storage``)."""
        return StorageStats(self.kind, self.bytes_read, self.bytes_written, self.read_ops,
                            self.write_ops, self.erase_ops, dict(self.erase_counts),
                            tuple(self.violations), dict(self.written_at))

    def _check_host_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity_bytes:
            raise ValueError(f"storage range {offset}..{offset + nbytes} is outside the "
                             f"{self.capacity_bytes}-byte {self.kind}")

    # -- sparse contents --------------------------------------------------------------------

    def _spans(self, offset: int, nbytes: int) -> Iterator[tuple[int, int, int, int]]:
        """(chunk index, start within the chunk, start within the range, length) for each chunk
        that the ``nbytes`` from ``offset`` touch."""
        pos = 0
        while pos < nbytes:
            index, within = divmod(offset + pos, self.CHUNK)
            take = min(self.CHUNK - within, nbytes - pos)
            yield index, within, pos, take
            pos += take

    def _new_chunk(self, index: int) -> np.ndarray:
        chunk = self._chunks[index] = np.full(self.CHUNK, self.erased_byte, dtype=np.uint8)
        return chunk

    def _get(self, offset: int, nbytes: int) -> np.ndarray:
        out = np.full(nbytes, self.erased_byte, dtype=np.uint8)
        for index, within, pos, take in self._spans(offset, nbytes):
            chunk = self._chunks.get(index)
            if chunk is not None:
                out[pos:pos + take] = chunk[within:within + take]
        return out

    def _put(self, offset: int, data: np.ndarray) -> None:
        for index, within, pos, take in self._spans(offset, data.size):
            chunk = self._chunks.get(index)
            if chunk is None:
                chunk = self._new_chunk(index)
            chunk[within:within + take] = data[pos:pos + take]

    def _fill(self, offset: int, nbytes: int, value: int) -> None:
        for index, within, _, take in self._spans(offset, nbytes):
            if within == 0 and take == self.CHUNK and value == self.erased_byte:
                self._chunks.pop(index, None)  # a whole erased chunk needs no storage
                continue
            chunk = self._chunks.get(index)
            if chunk is None and value != self.erased_byte:
                chunk = self._new_chunk(index)
            if chunk is not None:  # (an absent chunk already reads as erased)
                chunk[within:within + take] = value

    # -- device side: the controller's operations, with the kind's rules ---------------------

    def violation(self, op: str, offset: int, length: int, message: str, pc: tuple | int | None,
                  code: int) -> int:
        """Record an operation the device refuses; returns ``code``, the status it reports.
        ``pc``: the issuing basic block's pc, or (pc, the driver call's return address)."""
        pc, caller = pc if isinstance(pc, tuple) else (pc, None)
        self.violations.append(StorageViolation(op, offset, length, message, pc, caller))
        return code

    def _in_range(self, offset: int, length: int) -> bool:
        return 0 <= offset and offset + length <= self.target.addressable_bytes

    def device_read(self, offset: int, length: int, pc: tuple | int | None = None) -> tuple[int, np.ndarray | None]:
        if not self._in_range(offset, length):
            return self.violation("read", offset, length, f"outside the {self.capacity_bytes}-byte "
                                  f"{self.kind}", pc, STORAGE_E_RANGE), None
        if not self.target.is_flash and (offset % BLOCK_DEVICE_BLOCK_BYTES or length % BLOCK_DEVICE_BLOCK_BYTES):
            return self.violation("read", offset, length, f"a {self.kind} reads whole aligned "
                                  f"512-byte blocks", pc, STORAGE_E_ALIGN), None
        self.read_ops += 1
        self.bytes_read += length
        return STORAGE_OK, self._get(offset, length)

    def device_write(self, offset: int, data: np.ndarray, pc: tuple | int | None = None) -> int:
        length = int(data.size)
        if not self._in_range(offset, length):
            return self.violation("write", offset, length, f"outside the {self.capacity_bytes}-byte "
                                  f"{self.kind}", pc, STORAGE_E_RANGE)
        if self.target.is_flash:
            old = self._get(offset, length)
            raised = np.flatnonzero(data & ~old)
            if raised.size:
                first = int(raised[0])
                return self.violation(
                    "write", offset, length,
                    f"{raised.size} byte(s) would turn a 0 bit into 1 without an erase (first at "
                    f"offset {offset + first}: stored 0x{int(old[first]):02x}, written "
                    f"0x{int(data[first]):02x}); flash programming only clears bits",
                    pc, STORAGE_E_NOT_ERASED)
            # Programming ANDs into the cells; having checked, the result is the data itself.
            self._put(offset, data)
        else:
            if offset % BLOCK_DEVICE_BLOCK_BYTES or length % BLOCK_DEVICE_BLOCK_BYTES or length == 0:
                return self.violation("write", offset, length, f"a {self.kind} writes whole aligned "
                                      f"512-byte blocks", pc, STORAGE_E_ALIGN)
            self._put(offset, data)
            first_au = offset // self.erase_block_bytes
            last_au = (offset + length - 1) // self.erase_block_bytes
            if self.target.sequential_writes:
                # the units a write reaches past the first are entered at their start: rewritten
                # once each; the first only when the write does not continue the open unit
                for au in range(first_au, last_au + 1):
                    if au > first_au or self._open_unit != (first_au, offset):
                        self.erase_counts[au] += 1
                self._open_unit = (last_au, offset + length)
            else:
                for au in range(first_au, last_au + 1):
                    self.erase_counts[au] += 1
        self.write_ops += 1
        self.bytes_written += length
        self.written_at[offset] += length
        return STORAGE_OK

    def device_erase(self, block: int, pc: tuple | int | None = None) -> int:
        nblocks = -(-self.capacity_bytes // self.erase_block_bytes)
        if not 0 <= block < nblocks:
            return self.violation("erase", block * self.erase_block_bytes, self.erase_block_bytes,
                                  f"erase block {block} does not exist (the {self.kind} has "
                                  f"{nblocks})", pc, STORAGE_E_RANGE)
        start = block * self.erase_block_bytes
        self._fill(start, min(self.erase_block_bytes, self.capacity_bytes - start), self.erased_byte)
        self.erase_ops += 1
        self.erase_counts[block] += 1
        self._open_unit = None
        return STORAGE_OK
