"""The formulation's bookkeeping: column ids of a (stage, tensor) family, and rows accumulated in bulk.

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
import scipy.sparse as sp


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


class Rows:
    """Accumulates constraint rows as COO triplets, built from numpy arrays in bulk."""

    def __init__(self):
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lb: list[np.ndarray] = []
        self.ub: list[np.ndarray] = []
        self.count = 0

    def add(self, terms, lb, ub):
        """terms: list of (col_array, coef_array_or_scalar), all arrays of the same length m; one row
        per element. Columns < 0 are absent variables and are dropped."""
        m = len(np.asarray(terms[0][0]))
        row_ids = np.arange(self.count, self.count + m)
        for cols, coefs in terms:
            cols = np.asarray(cols)
            coefs = np.broadcast_to(np.asarray(coefs, dtype=float), cols.shape)
            present = cols >= 0
            self.rows.append(row_ids[present])
            self.cols.append(cols[present])
            self.vals.append(coefs[present])
        self.lb.append(np.broadcast_to(np.asarray(lb, dtype=float), (m,)))
        self.ub.append(np.broadcast_to(np.asarray(ub, dtype=float), (m,)))
        self.count += m

    def add_sparse(self, rows, cols, vals):
        """Extra terms for rows already added (rows are absolute ids)."""
        rows, cols = np.asarray(rows), np.asarray(cols)
        present = cols >= 0
        self.rows.append(rows[present])
        self.cols.append(cols[present])
        self.vals.append(np.broadcast_to(np.asarray(vals, dtype=float), rows.shape)[present])

    def add_row(self, cols, vals, lb, ub):
        """One row over many columns (a budget)."""
        cols = np.asarray(cols, dtype=np.int64)
        self.rows.append(np.full(len(cols), self.count))
        self.cols.append(cols)
        self.vals.append(np.asarray(vals, dtype=float))
        self.lb.append(np.array([lb], dtype=float))
        self.ub.append(np.array([ub], dtype=float))
        self.count += 1

    def matrix(self, num_vars: int):
        if not self.rows:
            return sp.csr_matrix((0, num_vars)), np.zeros(0), np.zeros(0)
        A = sp.csr_matrix(
            (np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
            shape=(self.count, num_vars),
        )
        A.sum_duplicates()
        return A, np.concatenate(self.lb), np.concatenate(self.ub)
