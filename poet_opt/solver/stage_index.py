"""Column ids of a (stage, tensor) family of MILP variables, stored over the model's own stages and tensors.

The full formulation has a column family per (stage t, tensor i): keep S[t,i], recompute R[t,i],
page-in Min[t,i]. Over the whole graph these are dense T x T arrays, which is what the full model
needs anyway. A window of stages a..b (solver/lns.py) has columns only in its stages and only for the
tensors that exist there (made by stage b, readable in stage a or later): indexing it by T x T arrays
cost gigabytes and seconds at ResNet-18's 9,350 nodes before a single column was made. A
``StageIndex`` stores the ids in an array over the window's stages and those tensors alone, and is
looked up by global (stage, tensor) ids, -1 where the model has no column.

Over the whole graph (``first == 0`` and every tensor) lookups go straight to the array, as the
dense arrays did (slices included), so the full model builds and orders its columns exactly as before.
"""

from __future__ import annotations

import numpy as np


class StageIndex:
    """ids[t, i] for stages first..first+rows-1 and the given tensors (sorted global ids); -1 elsewhere."""

    def __init__(self, first: int, rows: int, tensors: np.ndarray, n: int):
        self.first, self.rows = int(first), int(rows)
        self.tensors = np.asarray(tensors, dtype=np.int64)
        self.whole = self.first == 0 and len(self.tensors) == n
        self.loc = np.full(n, -1, dtype=np.int64)  # global tensor id -> local column of ``cols``
        self.loc[self.tensors] = np.arange(len(self.tensors))
        self.cols = np.full((self.rows, len(self.tensors)), -1, dtype=np.int64)

    # -- local coordinates ----------------------------------------------------------------------
    def stages(self) -> np.ndarray:
        """The global stage of each row, as a column vector (for masks over ``cols``)."""
        return (self.first + np.arange(self.rows))[:, None]

    def assign(self, mask: np.ndarray, ids: np.ndarray) -> None:
        """Give the (row, local tensor) cells of ``mask`` the column ids ``ids``, in row-major order."""
        self.cols[mask] = ids

    def to_global(self, rows: np.ndarray, locals_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return rows + self.first, self.tensors[locals_]

    def pairs(self, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Global (stage, tensor) of every cell with a column (and ``mask``, over ``cols``), row-major."""
        present = self.cols >= 0
        return self.to_global(*np.nonzero(present if mask is None else present & mask))

    def row(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The tensors with a column in stage t, and those columns."""
        r = t - self.first
        if not 0 <= r < self.rows:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        present = np.flatnonzero(self.cols[r] >= 0)
        return self.tensors[present], self.cols[r, present]

    def max(self) -> int:
        return int(self.cols.max(initial=-1))

    # -- lookups by global ids ------------------------------------------------------------------
    def __getitem__(self, key):
        if self.whole:
            return self.cols[key]
        t, i = key
        if isinstance(t, (int, np.integer)) and isinstance(i, (int, np.integer)):
            r, li = int(t) - self.first, int(self.loc[i]) if 0 <= i < len(self.loc) else -1
            return int(self.cols[r, li]) if 0 <= r < self.rows and li >= 0 else -1
        r = np.asarray(t, dtype=np.int64) - self.first
        li = self.loc[np.asarray(i, dtype=np.int64)]
        r, li = np.broadcast_arrays(r, li)
        ok = (r >= 0) & (r < self.rows) & (li >= 0)
        out = np.full(r.shape, -1, dtype=np.int64)
        out[ok] = self.cols[r[ok], li[ok]]
        return out
