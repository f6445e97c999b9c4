"""C sources that perform training steps exactly as a validated schedule says: ``generate`` picks
the writer for the network's graph, poet_opt/firmware/writer.py for whole tensors (its docstring
says what each node computes), poet_opt/firmware/strip_codegen.py for activation strips or
poet_opt/firmware/row_codegen.py for a transformer's row tiles."""

from __future__ import annotations

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.firmware.arena import ArenaPlan, FlashPlan
from poet_opt.firmware.row_codegen import RowWriter
from poet_opt.firmware.strip_codegen import StripWriter
from poet_opt.firmware.writer import (  # noqa: F401 (the names firmware callers use)
    KERNEL_FILES,
    PAGING_FILES,
    GeneratedStep,
    StepWriter,
    packed_params,
    param_layers,
    streams_weights,
)
from poet_opt.model.network import Network


def generate(network: Network, doc: dict, plan: ArenaPlan, flash: FlashPlan, *, steps: int, lr: float,
             x: np.ndarray, y: np.ndarray, program: bool | str = "auto", prefix: str = "poet_",
             storage_defines: dict | None = None, marks: bool = False) -> GeneratedStep:
    """The training step as a library (library.py: ``<prefix>train.c`` and ``.h``) and the example
    main() that runs ``steps`` SGD steps at ``lr`` on the batch ``x`` with labels ``y``; the step as
    straight-line C, or as a program of kernel calls (firmware/program.py): ``program`` True,
    False, or "auto" (a program for large steps). ``storage_defines``: the -D values of the storage
    geometry the sources were built with, written in a comment for a board to copy. ``marks``: a
    profiling build for the emulator, each schedule step marked in its trace register
    (writer.StepWriter)."""
    from poet_opt.model.rows import refuse_rows
    from poet_opt.model.strips import refuse_strips

    rows = network.graph.meta.get("rows") is not None
    if not rows:  # a row plan needs the network lowered with its row tiles (model/torch_rows.py)
        refuse_rows(doc["graph"]["nodes"], "the firmware generator for a network lowered without row tiles",
                    "--model")
    if network.graph.meta.get("strips") is None:  # a strip plan needs the network lowered with its strips
        refuse_strips(doc["graph"]["nodes"], "the firmware generator for a network lowered without strips",
                      "--model")
    names = [str(n["name"]) for n in doc["graph"]["nodes"]]
    if len(set(names)) < len(names):
        # the generator finds a node's operands by name: a layer named like a derived node
        # ("L@s0", "grad:L@1") would be read as that node
        twice = next(name for name in names if names.count(name) > 1)
        raise PoetError(f"two nodes of the graph are named {twice!r}: a module's name reads like a node derived "
                        "from another (a gradient, strip, slice or partial sum); rename it", field="--torch")
    if any(o % 4 for o in plan.step_offsets) or any(o % 4 for offs in plan.operand_offsets for o in offs):
        raise PoetError(f"device.alignment_bytes is {plan.alignment}; fp32 tensors need offsets that are "
                        "multiples of 4", field="--device")
    from poet_opt.firmware import library

    library.check_library_prefix(prefix)
    kind = RowWriter if rows else StripWriter if network.graph.meta.get("strips") is not None else StepWriter
    writer = kind(network, doc, plan, flash, lr, program, marks)
    return library.render(writer, steps=steps, lr=lr, x=x, y=y, prefix=prefix, storage_defines=storage_defines)
