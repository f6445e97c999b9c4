"""What the command does with SIGTERM and SIGINT before its own handlers are in place, and how a
signal is recognised once a library has wrapped it in an error of its own.

Importing click and the stages takes a second on a busy machine, and nothing is written before
the command runs: a signal then ends the process at once, with the command's exit code (143 or
130) and its one line. Imports nothing from poet_opt, so that cli.py can install it first.
"""

from __future__ import annotations

import os
import signal


def leave_at_once(signum, frame) -> None:
    how = "terminated" if signum == signal.SIGTERM else "interrupted"
    os.write(2, f"poet-opt: {how}; nothing was written\n".encode())
    os._exit(128 + signum)


def install_early() -> None:
    signal.signal(signal.SIGTERM, leave_at_once)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a shell ignores it
        signal.signal(signal.SIGINT, leave_at_once)


def signal_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (a Ctrl-C, or SIGTERM as the CLI raises it) an error was made from:
    a signal inside a native extension's import comes back as "ImportError: initialization
    failed" with the interrupt as its cause (pybind11), and is no internal error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
