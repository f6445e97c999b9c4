"""The one exception type that user-facing code raises for bad input.

The CLI turns a PoetError into a single line on stderr and exit code 2, so every message must
name the file (where there is one), the field, and the problem, and make sense on its own.
"""

from __future__ import annotations


class PoetError(Exception):
    """Bad input or an impossible request, reported to the user as one line."""

    exit_code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.message = message
        self.source = source
        self.field = field
        super().__init__(self.one_line())

    def one_line(self) -> str:
        parts = [p for p in (self.source, self.field) if p]
        prefix = ": ".join(parts)
        text = f"{prefix}: {self.message}" if prefix else self.message
        return " ".join(text.split())


class InfeasibleError(PoetError):
    """No schedule exists under the given budgets; carries the smallest RAM budget that works, and a
    proven lower bound on it (inf: no budget works; a sweep skips every budget below the bound)."""

    def __init__(self, message: str, *, min_ram_bytes: float | None = None,
                 min_ram_lower_bound: float | None = None, **kw):
        self.min_ram_bytes = min_ram_bytes
        self.min_ram_lower_bound = min_ram_lower_bound
        super().__init__(message, **kw)


class NoScheduleFound(PoetError):
    """The solver stopped (time limit, interrupt) before finding any valid schedule."""
