"""`poet-opt emulate` on a data set: shuffled batches handed to the firmware one at a time, through
the library's public API, as an application hands them from a sensor or a card; and accuracy before
and after, from the firmware's own ``predict`` on the emulated core.

One emulator run, one image: the harness (``poet_harness.c``, :func:`harness`) loops on a host turn,
``harness_next()``. The emulator calls :meth:`Feeder.turn` whenever the core enters it
(``Emulator.on_reach``); the host reads what the last command left (a loss, or logits), writes the
next batch into the harness's RAM buffers, as a peripheral's DMA would, and the command: train,
predict or stop. Nothing is recompiled per batch and the arena persists, as on a board.

The order is fixed by the seed: epoch e takes the samples in the order of the e-th
``numpy.random.default_rng(seed).permutation(N)`` drawn in turn, cut into batches of the plan's
batch size; a data set of one batch is not shuffled (its steps equal the single-batch harness's).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from poet_opt.errors import PoetError
from poet_opt.model.batch import check_x, load_batch

COMMAND_STOP, COMMAND_TRAIN, COMMAND_PREDICT = 0, 1, 2
# beyond this many steps --json gives each epoch's mean loss only: a list a person can still read
MAX_LISTED_LOSSES = 1000


def load_set(path, field_name: str) -> tuple[np.ndarray, np.ndarray]:
    """x (float32, samples first) and y (int64) of a data set; its problems name ``field_name``."""
    try:
        x, y = load_batch(path, token_ids=True)  # ids or features: check_inputs asks which the model reads
    except PoetError as exc:
        raise PoetError(exc.message, source=exc.source, field=field_name) from None
    if np.issubdtype(y.dtype, np.unsignedinteger) and y.size and int(y.max()) > np.iinfo(np.int64).max:
        return x, y  # as given, so the refusal names the label, not its int64 wrap-around
    return x, y.astype(np.int64)


def check_inputs(module, shape, sets: list) -> list:
    """Each data set's x as the model reads it (``sets``: (x or None, option) pairs): float32
    features, or int32 token ids below its smallest table, as `run` checks them (model/batch.py's
    check_x), before anything is solved; a problem names the set's option."""
    from poet_opt.model.torch_rows import input_vocabulary

    vocabulary = input_vocabulary(module, shape)
    out = []
    for x, field_name in sets:
        try:
            out.append(None if x is None else check_x(x, vocabulary))
        except PoetError as exc:
            raise PoetError(exc.message, field=field_name) from None
    return out


def check_set(x: np.ndarray, y: np.ndarray, sample_shape: tuple, classes: Optional[int], batch: int,
              field_name: str) -> int:
    """The number of whole batches in (x, y), after checking each sample's shape and (unless
    ``classes`` is None, before the model is traced) each label."""
    if tuple(x.shape[1:]) != tuple(sample_shape):
        raise PoetError(f"x has shape {','.join(map(str, x.shape))}, the model takes "
                        f"{','.join(map(str, (batch, *sample_shape)))} (samples first)", field=field_name)
    if classes is not None and ((y < 0).any() or (y >= classes).any()):
        bad = int(y[(y < 0) | (y >= classes)][0])
        raise PoetError(f"label {bad} is outside [0, {classes}) for this model's {classes} outputs", field=field_name)
    if x.shape[0] < batch:
        raise PoetError(f"{x.shape[0]} sample(s), fewer than one batch of {batch}", field=field_name)
    return x.shape[0] // batch


def batch_order(n: int, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    """The sample indices of each training step's batch (module docstring: the order)."""
    per_epoch = n // batch
    rng = np.random.default_rng(seed)
    out, order = [], np.arange(n)
    for step in range(steps):
        k = step % per_epoch
        if k == 0 and per_epoch > 1:
            order = rng.permutation(n)
        out.append(order[k * batch:(k + 1) * batch])
    return out


def harness(prefix: str, lr_literal: str, vocabulary: Optional[int] = None) -> str:
    """The emulator's main() for a data set: init, then whatever the host commands, batch by batch
    (``vocabulary``: the batch is int32 token ids, library.input_c_type)."""
    from poet_opt.firmware.library import input_c_type

    p, P = prefix, prefix.upper()
    ctype, count = input_c_type(prefix, vocabulary)
    return "\n".join([
        "#include <stdint.h>",
        f'#include "{p}train.h"',
        "",
        "/* the host's port: it fills these while the core is in harness_next(), as a DMA would */",
        f"__attribute__((used)) {ctype} harness_x[{count}];",
        f"__attribute__((used)) int32_t harness_y[{P}BATCH];",
        f"__attribute__((used)) float harness_logits[{P}LOGITS_FLOATS];",
        "__attribute__((used)) float harness_loss;",
        f"__attribute__((used)) volatile uint32_t harness_command; /* {COMMAND_STOP} stop, {COMMAND_TRAIN} train, "
        f"{COMMAND_PREDICT} predict */",
        "",
        "/* the host's turn: the asm keeps the compiler from proving the call changes no memory */",
        "__attribute__((noinline, used)) void harness_next(void)",
        "{",
        '    __asm__ volatile("" ::: "memory");',
        "}",
        "",
        "int main(void)",
        "{",
        f"    {p}status rc = {p}init();",
        f"    while (rc == {P}OK) {{",
        "        harness_next();",
        f"        if (harness_command == {COMMAND_TRAIN}u) {{",
        f"            rc = {p}train_step(harness_x, harness_y, {lr_literal}, &harness_loss);",
        f"        }} else if (harness_command == {COMMAND_PREDICT}u) {{",
        f"            rc = {p}predict(harness_x, harness_logits);",
        "        } else {",
        "            break;",
        "        }",
        "    }",
        "    return (int)rc;",
        "}",
        "",
    ])


@dataclass
class Feeder:
    """The host's side of the harness: the training batches in order, and the eval set's whole
    batches before and after training (the last partial batch is dropped: predict takes whole
    batches, and a batch norm without running statistics normalises with the batch's own, so
    padding would change the other samples' logits there)."""

    x: np.ndarray
    y: np.ndarray
    batch: int
    steps: int
    seed: int = 0
    eval_x: Optional[np.ndarray] = None
    eval_y: Optional[np.ndarray] = None
    bar: bool = False  # a tqdm bar on stderr
    losses: list = field(default_factory=list)
    accuracy: dict = field(default_factory=dict)  # "before"/"after" -> fraction of eval samples right
    # "before"/"after" -> the logits predict gave for each eval batch, in order: what the accuracy is
    # counted from, kept so that a test can hold them against PyTorch's
    predictions: dict = field(default_factory=lambda: {"before": [], "after": []})

    def __post_init__(self):
        self.per_epoch = self.x.shape[0] // self.batch
        self.epochs = -(-self.steps // self.per_epoch)
        order = batch_order(self.x.shape[0], self.batch, self.steps, self.seed)
        evals = [] if self.eval_x is None else [
            ("predict", np.arange(k * self.batch, (k + 1) * self.batch)) for k in
            range(self.eval_x.shape[0] // self.batch)]
        self.commands = [*((("predict", ix), "before") for _, ix in evals), *((("train", ix), None) for ix in order),
                         *((("predict", ix), "after") for _, ix in evals)]
        self.eval_samples = len(evals) * self.batch
        self._right = {"before": 0, "after": 0}
        self._next = 0
        self._progress = None

    def attach(self, emulator) -> None:
        self.emulator = emulator
        emulator.on_reach(emulator.symbol("harness_next").address, self.turn)
        if self.bar:
            from tqdm import tqdm

            self._progress = tqdm(total=self.steps, unit="step", file=sys.stderr, dynamic_ncols=True, leave=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def _write(self, name: str, values: np.ndarray) -> None:
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        mem, at = self.emulator.memory_at(self.emulator.symbol(name).address, raw.size)
        mem[at:at + raw.size] = raw

    def turn(self) -> None:
        """The core entered harness_next(): take the last command's result, give the next command."""
        emu = self.emulator
        if self._next > 0:
            (kind, ix), phase = self.commands[self._next - 1]
            if kind == "train":
                self.losses.append(float(emu.read_symbol("harness_loss", np.float32)[0]))
                if self._progress is not None:
                    step = len(self.losses)
                    epoch = (step - 1) // self.per_epoch + 1
                    self._progress.set_description(f"epoch {epoch}/{self.epochs}", refresh=False)
                    self._progress.set_postfix(loss=f"{self.losses[-1]:.4g}", refresh=False)
                    self._progress.update(1)
                    if step == self.steps:  # the last step shown before the bar clears, whatever the rate limit
                        self._progress.refresh()
            else:
                logits = emu.read_symbol("harness_logits", np.float32).reshape(self.batch, -1).copy()
                self.predictions[phase].append(logits)
                self._right[phase] += int((logits.argmax(axis=1) == self.eval_y[ix]).sum())
                if self._next == len(self.commands) or self.commands[self._next][1] != phase:
                    self.accuracy[phase] = self._right[phase] / self.eval_samples
        if self._next == len(self.commands):
            self._write("harness_command", np.array([COMMAND_STOP], np.uint32))
            return
        (kind, ix), _ = self.commands[self._next]
        source_x, source_y = (self.x, self.y) if kind == "train" else (self.eval_x, self.eval_y)
        self._write("harness_x", source_x[ix].astype(np.int32 if source_x.dtype.kind in "iu" else np.float32))
        self._write("harness_y", source_y[ix].astype(np.int32))
        self._write("harness_command", np.array([COMMAND_TRAIN if kind == "train" else COMMAND_PREDICT], np.uint32))
        self._next += 1

    def epoch_losses(self) -> list[float]:
        """Each epoch's mean loss (the last one's over the steps it ran)."""
        return [float(np.mean(self.losses[k:k + self.per_epoch])) for k in range(0, len(self.losses), self.per_epoch)]

    def summary(self) -> dict:
        out = {"batch_size": self.batch, "batches_per_epoch": self.per_epoch, "epochs": self.steps / self.per_epoch,
               "seed": self.seed, "epoch_loss": [v if np.isfinite(v) else None for v in self.epoch_losses()]}
        if self.eval_x is not None:
            out.update(eval_samples=self.eval_samples, accuracy_before=self.accuracy.get("before"),
                       accuracy_after=self.accuracy.get("after"))
        return out
