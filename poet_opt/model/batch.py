"""The training batch of `poet-opt emulate` and `poet-opt run`: an .npz with ``x`` (float32, batch
first; for `run`, integer token ids when the model's input goes into an embedding) and ``y`` (one
integer class label per sample)."""

from __future__ import annotations

import math
import zipfile
from typing import Optional

import numpy as np

from poet_opt.errors import PoetError, TrainingDiverged

# A batch is one training step's input, read whole into memory (and, for `emulate`, into the
# firmware's flash image): far above any such batch, far below what would exhaust the machine.
MAX_BATCH_BYTES = 1 << 30


def load_batch(path, input_shape: Optional[tuple[int, ...]] = None, *,
               token_ids: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (float32, batch first) and ``y`` (integer class labels, one per sample) from an .npz.
    Each array's shape is read from its header and checked (against ``input_shape``, against the
    bytes the file holds, against MAX_BATCH_BYTES) before any memory is set aside for it.
    ``token_ids``: an integer ``x`` is accepted too (the caller checks it against the model with
    :func:`check_x` once it knows whether the model reads token ids)."""
    try:
        _check_headers(path, input_shape)
        with np.load(path, allow_pickle=False) as data:
            if "x" not in data or "y" not in data:
                raise PoetError(f"{path} holds {sorted(data.files)}; expected arrays 'x' and 'y'", field="--data")
            x, y = np.asarray(data["x"]), np.asarray(data["y"])
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise PoetError(f"cannot read {path} as .npz: {exc}", field="--data") from None
    return check_batch(x, y, input_shape, token_ids=token_ids)


def check_batch(x: np.ndarray, y: np.ndarray, input_shape: Optional[tuple[int, ...]] = None, *,
                token_ids: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`load_batch` asks of a file's arrays, asked of arrays already in memory."""
    if x.dtype != np.float32 and not (token_ids and np.issubdtype(x.dtype, np.integer)):
        raise PoetError(f"x is {x.dtype}; expected float32" + (" (or integer token ids)" if token_ids else ""),
                        field="--data")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1 or x.ndim < 2 or y.shape[0] != x.shape[0]:
        raise PoetError(f"y has shape {y.shape} and type {y.dtype}; expected one integer label per sample of x "
                        f"(batch {x.shape[0] if x.ndim else '?'})", field="--data")
    if input_shape is not None and tuple(x.shape) != tuple(input_shape):
        raise PoetError(f"x has shape {','.join(map(str, x.shape))}, the model takes "
                        f"{','.join(map(str, input_shape))}", field="--data")
    if not np.isfinite(x).all():
        raise PoetError("x holds NaN or infinity", field="--data")
    return x, y


def check_x(x, vocabulary: Optional[int]) -> np.ndarray:
    """The one rule for `run`'s x against its model: float32 features, or, when the model's input
    goes into embeddings (``vocabulary``: the rows of the smallest such table), integer token ids
    in [0, vocabulary), returned as int32: 4 bytes each, as the training graph counts the input."""
    x = np.asarray(x)
    integer = np.issubdtype(x.dtype, np.integer)
    if vocabulary is None:
        if x.dtype != np.float32:
            why = " (this model's input is features, not token ids)" if integer else ""
            raise PoetError(f"x is {x.dtype}; expected float32{why}", field="--data")
        return x
    if not integer:
        raise PoetError(f"x is {x.dtype}; this model's input is token ids into an embedding of {vocabulary:,} rows: "
                        "expected integers", field="--data")
    if x.size and (int(x.min()) < 0 or int(x.max()) >= vocabulary):
        raise PoetError(f"x holds token ids from {int(x.min())} to {int(x.max())}; this model's embedding has "
                        f"{vocabulary:,} rows, so they must lie in [0, {vocabulary})", field="--data")
    return x.astype(np.int32)


def check_labels(y, classes: int) -> np.ndarray:
    """The one rule for labels, `emulate`'s and `run`'s: one per sample, of any integer type, each
    in [0, classes); returned as int64."""
    y = np.asarray(y)
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise PoetError(f"y has shape {y.shape} and type {y.dtype}; expected one integer class label per sample",
                        field="--data")
    if (y < 0).any() or (y >= classes).any():
        raise PoetError(f"labels must lie in [0, {classes}) for this model's {classes} outputs", field="--data")
    return y.astype(np.int64)


def divergence(losses, weights) -> TrainingDiverged | None:
    """Why a training run diverged, or None when every loss and weight is finite."""
    bad = [k + 1 for k, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        return TrainingDiverged(f"training diverged: the loss is not finite from step {bad[0]}; try a smaller "
                                "learning rate", field="--lr")
    if any(not np.isfinite(w).all() for w in weights.values()):
        return TrainingDiverged("training diverged: some trained weights are not finite; try a smaller learning "
                                "rate", field="--lr")
    return None


def finite_or_none(value: float):
    """A figure as JSON can carry it: NaN and infinity are not JSON, null is."""
    return float(value) if math.isfinite(value) else None


def _check_headers(path, input_shape) -> None:
    """np.load sets aside the memory an array's header claims before reading its data: a 100-byte
    file claiming shape (10**12,) would end in MemoryError."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        return  # np.load says what is wrong with it
    with archive:
        for info in archive.infolist():
            name = info.filename[:-4] if info.filename.endswith(".npy") else None
            if name not in ("x", "y"):
                continue
            with archive.open(info) as fh:
                try:
                    version = np.lib.format.read_magic(fh)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(fh)
                    header_bytes = fh.tell()
                except (ValueError, TypeError, EOFError):
                    return  # np.load says what is wrong with it
            nbytes = math.prod(shape) * dtype.itemsize
            shown = ",".join(map(str, shape))
            if name == "x" and input_shape is not None and tuple(shape) != tuple(input_shape):
                raise PoetError(f"x has shape {shown}, the model takes {','.join(map(str, input_shape))}",
                                field="--data")
            if nbytes > MAX_BATCH_BYTES:
                raise PoetError(f"{name} has shape {shown}: {nbytes:,} B, more than a batch may hold "
                                f"({MAX_BATCH_BYTES:,} B)", field="--data")
            if nbytes > info.file_size - header_bytes:
                raise PoetError(f"{name}'s header claims shape {shown} ({nbytes:,} B), but the file holds "
                                f"{max(0, info.file_size - header_bytes):,} B of data", field="--data")
