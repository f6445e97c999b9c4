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
    """No schedule under the given budgets; carries the smallest RAM budget that works, and a proven
    lower bound on it (inf: no budget works; a sweep skips every budget below the bound). ``proven``:
    no schedule exists in any execution order; False: none in the orders tried (the budget and the
    bound then speak of those orders only)."""

    def __init__(self, message: str, *, min_ram_bytes: float | None = None,
                 min_ram_lower_bound: float | None = None, proven: bool = True, **kw):
        self.min_ram_bytes = min_ram_bytes
        self.min_ram_lower_bound = min_ram_lower_bound
        self.proven = proven
        super().__init__(message, **kw)


class NoScheduleFound(PoetError):
    """The solver stopped (time limit, interrupt) before finding any valid schedule."""


def shown(value, limit: int = 60) -> str:
    """A value quoted in a message, cut short: input may be a 400-digit number or a structure that
    YAML aliases blew up, and the message must stay one readable line."""
    import reprlib

    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**24:
        return f"an integer of {len(str(abs(value)))} digits"
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 6
    short.maxlevel = 3
    return short.repr(value)


class TrainingDiverged(PoetError):
    """Training ran, and its loss or weights are no longer finite (NaN or infinity: too large a
    learning rate, say). `run` and `emulate` print their result, with null for each such figure,
    then this, and exit 4."""

    exit_code = 4


class SolveInterrupted(NoScheduleFound):
    """Ctrl-C stopped the solver before it found any valid schedule."""

    exit_code = 130


class DeadlinePassed(Exception):
    """A long replay passed the ``time.perf_counter()`` deadline its caller gave: internal, caught
    by the solver phase that set the deadline (which then leaves that plan out), never shown."""
