"""The one way text gets into generated C: the header, the training firmware, the board files.

Names come from the user's files (torch modules and parameters, ONNX nodes, node-link graphs,
device profiles) and may hold anything: an attacker's ``*/ #define ...``, a newline, a trigraph, a
NUL, U+202E. They never become C tokens. Identifiers are generated from the tool's own roles and
counters (``identifier``); a name appears only inside a comment (``comment``) or a string literal
(``string_literal``), escaped so that it cannot end either, splice a line, form a trigraph, or
change what a reader sees (docs/c-export.md, "Header layout").
"""

from __future__ import annotations

import math
import re

from poet_opt.errors import PoetError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# C99 5.2.4.1: the longest string literal every compiler must accept, after concatenation; clang
# and gcc hold `-pedantic` builds to it (-Woverlength-strings)
MAX_STRING_BYTES = 4095
TRUNCATION_MARK = "..."


def check_identifier(text: str, *, field: str | None = None, what: str = "a C identifier") -> str:
    """``text`` if it is a C identifier (letters, digits, _; not starting with a digit), else PoetError."""
    if not isinstance(text, str) or not _IDENTIFIER.match(text):
        raise PoetError(f"{text!r} is not {what} (letters, digits, _; not starting with a digit)", field=field)
    return text


def check_prefix(prefix: str) -> None:
    check_identifier(prefix, field="--prefix", what="a C identifier prefix")


def identifier(*parts) -> str:
    """A C name joined from the generator's own parts (a role such as ``weight``, a counter), never
    from a user's name: the parts are checked, so a name slipped in by mistake fails loudly here
    instead of reaching the compiler."""
    own = [isinstance(p, int) and not isinstance(p, bool) and p >= 0 or isinstance(p, str) and _IDENTIFIER.match(p)
           for p in parts]
    if not parts or not all(own) or isinstance(parts[0], int):
        raise AssertionError(f"internal: a C identifier built from {parts!r}, which are not the generator's own")
    return "_".join(str(p) for p in parts)


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def comment(text) -> str:
    """``text`` to sit inside a /* */ comment on one line: printable ASCII kept, everything else
    (newline, CR, tab, NUL, U+202E and all non-ASCII) and whatever could end the comment (``*/``),
    open a nested one (``/*``, -Wcomment), form a trigraph (``??/`` is a backslash under
    -std=c99) or splice lines (a backslash) written as a \\xNN / \\uNNNN / \\UNNNNNNNN escape.
    A ``*``, ``/`` or ``?`` at either end is escaped too, so the result is safe beside any
    template text: ``"/* " + comment(a) + comment(b) + " */"`` cannot be broken by a or b."""
    text = str(text)
    out = []
    last = len(text) - 1
    for k, ch in enumerate(text):
        before, after = text[k - 1:k], text[k + 1:k + 2]
        edge = k == 0 or k == last
        risky = (ch == "\\"
                 or (ch in "*/" and (edge or (ch == "/" and "*" in (before, after))))
                 or (ch == "?" and (edge or "?" in (before, after))))
        out.append(_escape(ch) if risky or not " " <= ch <= "~" else ch)
    return "".join(out)


def block_comment(*parts) -> str:
    """A whole one-line /* */ comment holding the parts, each escaped (``comment``)."""
    return "/* " + " ".join(comment(p) for p in parts) + " */"


def _utf8(text: str) -> bytes:
    # surrogatepass: JSON may carry a lone surrogate, which has no UTF-8; keep its code unit
    return text.encode("utf-8", "surrogatepass")


def truncated(text: str, limit: int = MAX_STRING_BYTES) -> str:
    """``text`` if its UTF-8 fits ``limit`` bytes; else the longest prefix of whole characters that
    fits with TRUNCATION_MARK after it."""
    if len(_utf8(text)) <= limit:
        return text
    room = limit - len(TRUNCATION_MARK)
    keep, used = 0, 0
    for ch in text:
        size = len(_utf8(ch))
        if used + size > room:
            break
        keep, used = keep + 1, used + size
    return text[:keep] + TRUNCATION_MARK


def string_literal(text: str) -> str:
    """A C string literal holding ``text``'s UTF-8 bytes exactly (up to MAX_STRING_BYTES, else
    ``truncated``): printable ASCII as itself except ``"``, ``\\`` and ``?`` (``??`` could start a
    trigraph), every other byte as a three-digit octal escape, which cannot swallow a following
    digit. A NUL in the name ends the C string there, as C strings end."""
    out = []
    for ch in truncated(str(text)):
        if ch in '"\\?':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.extend(f"\\{b:03o}" for b in _utf8(ch))
    return '"' + "".join(out) + '"'


def uint_literal(value) -> str:
    """A non-negative integer as an unsigned C constant (``12u``); anything else is an internal error."""
    if isinstance(value, bool) or int(value) != value or value < 0 or value >= 1 << 64:
        raise AssertionError(f"internal: {value!r} is not an unsigned C constant")
    return f"{int(value)}u"


def float_literal(value: float, *, field: str = "--data") -> str:
    """A float as an exact C99 hexadecimal float constant (``0x1.8p+1f``)."""
    import numpy as np

    v = float(np.float32(value))
    if not math.isfinite(v):
        raise PoetError(f"a weight or input value is {v}; the firmware starts from finite numbers", field=field)
    return f"{v.hex()}f" if v else "0.0f"


_CONSTANT = re.compile(r"(0[xX][0-9A-Fa-f]+|[0-9]+)([uU]?[lL]{0,2}|[lL]{1,2}[uU]?)\Z")


def constant(value) -> str:
    """An integer constant for a ``-D`` value or a table (``12``, ``0xFFu``, ``16777216ULL``): the
    generator's own numbers, checked so that no other text can pass as one."""
    text = str(int(value)) if isinstance(value, int) and not isinstance(value, bool) else str(value)
    if not _CONSTANT.match(text):
        raise AssertionError(f"internal: {value!r} is not a C integer constant")
    return text
