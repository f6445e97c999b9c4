"""Files the tool writes: whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from poet_opt.errors import PoetError


def write_json_atomic(doc: dict, path: str | Path, *, field: str = "--out") -> None:
    def dump(fh):
        json.dump(doc, fh, indent=1)
        fh.write("\n")

    _write_atomic(path, dump, field)


def write_text_atomic(text: str, path: str | Path, *, field: str = "--out") -> None:
    _write_atomic(path, lambda fh: fh.write(text), field)


def _write_atomic(path: str | Path, write, field: str) -> None:
    """Write next to the target and rename, so a crash or a full disk never leaves half a file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        raise PoetError(f"cannot write here: {exc.strerror}", source=str(path), field=field) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            write(fh)
        # mkstemp creates 0600; give the file the mode an ordinary open() would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
