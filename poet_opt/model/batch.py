"""The training batch of `poet-opt emulate` and `poet-opt run`: an .npz with ``x`` (float32, batch
first) and ``y`` (one integer class label per sample)."""

from __future__ import annotations

import zipfile
from typing import Optional

import numpy as np

from poet_opt.errors import PoetError


def load_batch(path, input_shape: Optional[tuple[int, ...]] = None) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (float32, batch first) and ``y`` (integer class labels, one per sample) from an .npz."""
    try:
        with np.load(path, allow_pickle=False) as data:
            if "x" not in data or "y" not in data:
                raise PoetError(f"{path} holds {sorted(data.files)}; expected arrays 'x' and 'y'", field="--data")
            x, y = np.asarray(data["x"]), np.asarray(data["y"])
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise PoetError(f"cannot read {path} as .npz: {exc}", field="--data") from None
    if x.dtype != np.float32:
        raise PoetError(f"x is {x.dtype}; expected float32", field="--data")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1 or x.ndim < 2 or y.shape[0] != x.shape[0]:
        raise PoetError(f"y has shape {y.shape} and type {y.dtype}; expected one integer label per sample of x "
                        f"(batch {x.shape[0] if x.ndim else '?'})", field="--data")
    if input_shape is not None and tuple(x.shape) != tuple(input_shape):
        raise PoetError(f"x has shape {','.join(map(str, x.shape))}, the model takes "
                        f"{','.join(map(str, input_shape))}", field="--data")
    if not np.isfinite(x).all():
        raise PoetError("x holds NaN or infinity", field="--data")
    return x, y
