"""The emulator's cycle estimate: a cost in cycles per instruction class, for each core.

board/host_icount.c sorts every executed Thumb instruction into one of ``CLASSES`` when it first
decodes a basic block and caches the block's cost beside its instruction count, so the estimate
costs nothing per executed instruction. A block entered other than by falling through from the
previous one was reached by a taken branch, a call or a return: it adds ``taken`` (the pipeline
refill) plus the flash wait states of the profile (``compute.flash_wait_states``: what a
non-sequential fetch waits for after the part's prefetch buffer or cache; sequential fetches are
taken to be hidden by it).

The figures are the cores' documented instruction timings at zero wait states:

- Cortex-M4 and M3: Cortex-M4 Technical Reference Manual (ARM DDI 0439), table 3-1 (also printed
  as table 3-25 of TI's SWCU192), and for the FPU table 7-1: data processing and multiplies 1,
  SDIV/UDIV 2 to 12 (7 taken, the middle of the range), loads and stores 2, or 1 when next to
  another load or store ("neighboring load and store single instructions can pipeline their
  address and data phases"), LDM/STM/PUSH/POP and VLDM/VSTM 1 + N, branches 1 + P with P the
  refill, 1 to 3 (2 taken); VADD/VSUB/VMUL/VABS/VNEG/VCMP/VCVT/VMOV 1, VLDR/VSTR 2 (pipelined like
  integer loads), VMLA/VMLS/VFMA/VFMS/VFNMA 3, VDIV/VSQRT 14.
- Cortex-M0+: Cortex-M0+ Technical Reference Manual (ARM DDI 0484), table 3-1: data processing 1,
  MULS 1 (the single-cycle multiplier, as on the SAMD21), loads and stores 2 (no pipelining),
  LDM/STM/PUSH/POP 1 + N, branch taken 2, not taken 1, BL 3, BX/BLX 2. Cortex-M0 (ARM DDI 0432):
  branch taken 3, BL 4.
- Cortex-M7: its manual publishes no per-instruction timings. ESTIMATE from its documented
  pipeline (single-cycle loads from TCM or the L1 cache, a fully pipelined single-precision FPU
  that issues a VFMA or VMUL every cycle, VDIV/VSQRT 14 cycles for single precision, a branch
  target cache): 1 cycle per instruction except divides (7) and FP divide/square root (14), and
  1 for a taken branch. The M7 issues two instructions per cycle in many pairs, which this single-
  issue table ignores, so for it the estimate is an upper bound, by up to a factor of 2.

Not modelled: data wait states (RAM is taken as zero-wait), cache misses, bus contention, the
early termination of a divide, the M4's FPU register dependencies (a VADD using the previous
VMLA's result stalls), and the M7's dual issue.
"""

from __future__ import annotations

from dataclasses import dataclass

# Keep in step with the enum poet_icount_class in board/host_icount.c (same order).
CLASSES = ("alu", "mul", "div", "load", "load_next", "multi", "multi_word", "branch", "call", "fp_load",
           "fp_load_next", "fp_alu", "fp_mac", "fp_div", "fp_transfer", "taken")


@dataclass(frozen=True)
class CycleTable:
    """Cycles per instruction class of one core (``CLASSES``), and where the figures come from."""

    core: str
    costs: dict[str, int]
    source: str

    def vector(self) -> list[int]:
        return [int(self.costs[c]) for c in CLASSES]


_M4 = {"alu": 1, "mul": 1, "div": 7, "load": 2, "load_next": 1, "multi": 1, "multi_word": 1, "branch": 1,
       "call": 1, "fp_load": 2, "fp_load_next": 1, "fp_alu": 1, "fp_mac": 3, "fp_div": 14, "fp_transfer": 1,
       "taken": 2}
_M0PLUS = {"alu": 1, "mul": 1, "div": 1, "load": 2, "load_next": 2, "multi": 1, "multi_word": 1, "branch": 1,
           "call": 2, "fp_load": 2, "fp_load_next": 2, "fp_alu": 1, "fp_mac": 1, "fp_div": 1, "fp_transfer": 1,
           "taken": 1}
_M7 = {"alu": 1, "mul": 1, "div": 7, "load": 1, "load_next": 1, "multi": 1, "multi_word": 1, "branch": 1,
       "call": 1, "fp_load": 1, "fp_load_next": 1, "fp_alu": 1, "fp_mac": 1, "fp_div": 14, "fp_transfer": 1,
       "taken": 1}

_TRM_M4 = "Cortex-M4 TRM (ARM DDI 0439) tables 3-1 and 7-1"
_TRM_M0 = "Cortex-M0+ TRM (ARM DDI 0484) table 3-1"
TABLES: dict[str, CycleTable] = {
    "cortex-m0plus": CycleTable("cortex-m0plus", _M0PLUS, _TRM_M0),
    "cortex-m0": CycleTable("cortex-m0", {**_M0PLUS, "taken": 2, "call": 2}, "Cortex-M0 TRM (ARM DDI 0432) table 3-1"),
    "cortex-m3": CycleTable("cortex-m3", _M4, "Cortex-M3 TRM (ARM DDI 0337) table 18-1, as the M4's"),
    "cortex-m4": CycleTable("cortex-m4", _M4, _TRM_M4),
    "cortex-m4f": CycleTable("cortex-m4f", _M4, _TRM_M4),
    "cortex-m7": CycleTable("cortex-m7", _M7, "ESTIMATE (no published table; see module docstring)"),
    "cortex-m7f": CycleTable("cortex-m7f", _M7, "ESTIMATE (no published table; see module docstring)"),
    "cortex-m7fd": CycleTable("cortex-m7fd", _M7, "ESTIMATE (no published table; see module docstring)"),
}


def cycle_table(core: str) -> CycleTable:
    """The table of a ``targets.CORES`` key."""
    return TABLES[core]


def taken_branch_cycles(core: str, flash_wait_states: int = 0) -> int:
    """What a taken branch adds to its own cycle: the refill plus the wait of a fetch from flash."""
    return int(TABLES[core].costs["taken"]) + int(flash_wait_states)
