"""What the command does with SIGTERM and SIGINT before its own handlers are in place, and how a
signal is recognised once a library has wrapped it in an error of its own.

Importing click and the stages takes a second on a busy machine, and nothing is written before
the command runs: a signal then ends the process at once, with the command's exit code (143 or
130) and its one line. Imports nothing from poet_opt, so that cli.py can install it first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time


def leave_at_once(signum, frame) -> None:
    how = "terminated" if signum == signal.SIGTERM else "interrupted"
    os.write(2, f"poet-opt: {how}; nothing was written\n".encode())
    os._exit(128 + signum)


def install_early(module_name: str) -> None:
    """From cli.py's first lines, when it runs as the command (not when a test or a notebook imports it)."""
    if module_name != "__main__" and os.path.basename(sys.argv[0]) != "poet-opt":
        return
    signal.signal(signal.SIGTERM, leave_at_once)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a shell ignores it
        signal.signal(signal.SIGINT, leave_at_once)


# How long a command has to end on its own after SIGTERM, its cleanup included, before it is ended.
TERMINATE_GRACE_S = 5.0


def end_unless_ended(code: int, after_s: float = TERMINATE_GRACE_S) -> None:
    """A backstop for a signal whose exception got lost: raised while Python runs a __del__ or a
    weakref callback, it is printed as "Exception ignored" and the program runs on (once in 30
    signals: a SIGTERM 3.5 s into ResNet-50's solve ran it to its end, exit 0). Ends the process
    with ``code`` ``after_s`` seconds on, unless it has ended by then."""
    def later() -> None:
        time.sleep(after_s)
        os.write(2, b"poet-opt: terminated\n")
        os._exit(code)

    threading.Thread(target=later, name="poet-terminate", daemon=True).start()


# The pause before a lost signal is delivered again: long enough for the finalizer that swallowed
# it to return (if it lands in another, it is delivered again), short beside a person's patience.
REDELIVER_AFTER_S = 0.02


# Set once the command has decided how it ends (its exit code and message): a lost signal's re-sending
# stops there. Seen in CI: a Ctrl-C during `run`'s solve both stopped the solve and, lost in a
# finalizer on the way, was sent again 20 ms later, while `run` was leaving with 130 after printing
# "interrupted": that second KeyboardInterrupt replaced the exit, and Python left through SIGINT (-2).
_ENDING = threading.Event()
_SENDING = threading.Lock()


def command_ending() -> None:
    """The command has decided how it ends: no lost signal is sent again after this returns."""
    with _SENDING:
        _ENDING.set()


def redeliver_lost_signals():
    """While a command runs: a Ctrl-C or SIGTERM whose exception is raised inside a finalizer (a
    __del__, a weakref callback such as importlib's module locks', run by a garbage collection or a
    first import in a training step) is not printed as "Exception ignored" and lost, but delivered to
    the main thread again, where it ends the command as any other (seen in CI: a Ctrl-C 0.1 s into
    `run`'s first step, then 100,000 steps). The exception's ``signum`` names the signal (SIGINT
    when it has none). Returns the function that puts the previous hook back."""
    import _thread

    previous = sys.unraisablehook
    _ENDING.clear()

    def again(signum: int) -> None:
        time.sleep(REDELIVER_AFTER_S)
        with _SENDING:
            if _ENDING.is_set():  # the command ends already: a second signal would only change how
                return
            if hasattr(signal, "pthread_kill"):  # a real signal: it also ends a blocking call (a sleep, a read)
                signal.pthread_kill(threading.main_thread().ident, signum)
            else:
                _thread.interrupt_main(signum)

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # from another thread, a moment later: delivered here, the handler would raise inside
            # this hook (inside the finalizer still), and be lost again
            threading.Thread(target=again, args=(getattr(unraisable.exc_value, "signum", signal.SIGINT),),
                             name="poet-signal-again", daemon=True).start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook

    def undo() -> None:
        command_ending()
        sys.unraisablehook = previous

    return undo


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


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM wait for the end of the block, and are then raised as usual. For a block
    that runs finalizers (a garbage collection): a signal raised inside a __del__ or a weakref
    callback is printed as "Exception ignored" and lost, and the command would run on to exit 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Python-level handlers that only note the signal, not a blocked mask: the kernel hands a
    # process-directed signal to any thread that does not block it (torch's, a solver's), and the
    # interpreter then runs the handler in the main thread inside the block after all (seen in CI)
    pending: list[int] = []

    def note(signum, frame):
        pending.append(signum)

    held = (signal.SIGINT, signal.SIGTERM)
    saved = {s: signal.signal(s, note) for s in held}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler if handler is not None else
                          (signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL))
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)  # now, to the handlers the block found
