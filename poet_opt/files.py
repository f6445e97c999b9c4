"""Files at the tool's edge: YAML read without letting a hostile file exhaust the interpreter,
outputs that never replace an input, and writes that land whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from poet_opt.errors import PoetError

# A profile nests three levels and a cost file two; these only stop files built to hurt.
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 1_000_000  # values in the document once every alias is expanded


class YAMLLimitError(yaml.MarkedYAMLError):
    """A YAML document refused for its shape (depth, alias expansion) or an unreadable value;
    callers report it like any other YAML error, with its line."""

    def __init__(self, problem: str, mark=None):
        super().__init__(problem=problem, problem_mark=mark)


def load_yaml(text: str):
    """``yaml.safe_load``, except that nesting deeper than MAX_YAML_DEPTH and aliases expanding past
    MAX_YAML_NODES values are refused from the parser's events, before any object is built: deep
    nesting would end in RecursionError, and an alias bomb ("billion laughs") in a hang wherever
    the result is walked or printed."""
    _check_shape(text)
    try:
        return yaml.load(text, Loader=yaml.SafeLoader)
    except RecursionError:  # _check_shape bounds the depth; kept so that nothing can escape as a crash
        raise YAMLLimitError(f"nested too deeply (more than {MAX_YAML_DEPTH} levels)") from None
    except ValueError as exc:  # an integer of over 4300 digits, a date like 2024-13-45
        raise YAMLLimitError(f"a value cannot be read: {' '.join(str(exc).split(';')[0].split())}") from None


def _check_shape(text: str) -> None:
    # Each open collection is a frame [anchor, values in it, height]; an anchor records the size and
    # height of its node, so an alias costs what it expands to without being expanded.
    anchors: dict = {}
    frames = [[None, 0, 0]]
    total = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(frames) > MAX_YAML_DEPTH:
                raise YAMLLimitError(f"nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark)
            if event.anchor:
                anchors[event.anchor] = None  # open: an alias to it from inside would be a cycle
            frames.append([event.anchor, 1, 1])
            size, height = 1, None
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, size, height = frames.pop()
            if anchor:
                anchors[anchor] = (size, height)
            _add(frames[-1], size, height)
            continue
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor:
                anchors[event.anchor] = (1, 0)
            size, height = 1, 0
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in anchors:
                continue  # the loader reports the undefined alias with its line
            if anchors[event.anchor] is None:
                raise YAMLLimitError(f"alias *{event.anchor} refers to a node that contains it", event.start_mark)
            size, height = anchors[event.anchor]
            if len(frames) - 1 + height > MAX_YAML_DEPTH:
                raise YAMLLimitError(f"alias *{event.anchor} nests the document more than {MAX_YAML_DEPTH} levels "
                                     "deep", event.start_mark)
        else:
            continue
        total += size
        if total > MAX_YAML_NODES:
            how = f" through alias *{event.anchor}" if isinstance(event, yaml.AliasEvent) else ""
            raise YAMLLimitError(f"expands to more than {MAX_YAML_NODES:,} values{how}", event.start_mark)
        if height is not None:  # a collection joins its parent when it ends
            _add(frames[-1], size, height)


def _add(frame: list, size: int, height: int) -> None:
    frame[1] += size
    frame[2] = max(frame[2], height + 1)


def check_not_inputs(outputs, inputs) -> None:
    """Refuse an output path that is an input, or another output, of the same command: writing it
    would replace the file being read. ``outputs`` and ``inputs``: (option, path or None) pairs;
    a command that writes a directory lists each file it writes there (``write_files``)."""
    seen = [(option, path) for option, path in inputs if path is not None]
    for option, out in outputs:
        if out is None:
            continue
        for other, path in seen:
            if _same_file(out, path):
                raise PoetError(f"is the same file as {other}, which it would overwrite; give {option} a "
                                "name of its own", source=str(out), field=option)
        seen.append((option, out))


def _identities(path) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of the file at ``path`` and, when it is a symbolic link, of the link itself:
    a hard link, a symbolic link or another spelling of an input is the input."""
    found = set()
    for stat in (os.stat, os.lstat):
        try:
            st = stat(path)
        except (OSError, ValueError):  # missing, a dangling link, a NUL in the name
            continue
        found.add((st.st_dev, st.st_ino))
    return found


def _same_file(a, b) -> bool:
    ids = _identities(a)
    if ids:
        return bool(ids & _identities(b))
    # it does not exist yet: two outputs are still one when their paths are one
    return Path(os.path.abspath(a)) == Path(os.path.abspath(b)) or Path(a).resolve() == Path(b).resolve()


def write_files(directory, files, *, field: str, inputs=()) -> list[Path]:
    """Write each ``name -> bytes or source Path`` of ``files`` into ``directory`` (created if
    missing), each through ``write_atomic``: refused, before anything is written, when one of them
    is one of ``inputs`` ((option, path) pairs); an entry there that is a symbolic link is replaced,
    never followed. Returns the paths written."""
    directory = Path(directory)
    targets = {name: directory / name for name in files}
    for name in files:
        if Path(name).name != name or name in ("", ".", ".."):
            raise AssertionError(f"internal: {name!r} is not a file name")
    check_not_inputs([(field, path) for path in targets.values()], inputs)
    for name, content in files.items():
        data = Path(content).read_bytes() if isinstance(content, Path) else content
        write_atomic(targets[name], lambda fh, data=data: fh.write(data), field=field, binary=True)
    return list(targets.values())


def write_json_atomic(doc: dict, path: str | Path, *, field: str = "--out") -> None:
    def dump(fh):
        json.dump(doc, fh, indent=1)
        fh.write("\n")

    write_atomic(path, dump, field=field)


def write_text_atomic(text: str, path: str | Path, *, field: str = "--out") -> None:
    write_atomic(path, lambda fh: fh.write(text), field=field)


def write_atomic(path: str | Path, write, *, field: str = "--out", binary: bool = False,
                 newline: str | None = None) -> None:
    """Call ``write(fh)`` on a temporary file next to the target, then rename it over the target,
    so that a crash, a full disk or a kill (the CLI turns SIGTERM into an exception) never leaves
    half a file, nor the temporary. The temporary is created exclusively (O_EXCL: never through a
    link planted under its name), and the rename replaces a link at the target rather than
    writing through it, so nothing outside the target's directory is ever written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PoetError(f"cannot write here: {exc.strerror}", source=str(path), field=field) from None
    tmp = None
    try:
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        except OSError as exc:
            raise PoetError(f"cannot write here: {exc.strerror}", source=str(path), field=field) from None
        mode = {"mode": "wb"} if binary else {"mode": "w", "encoding": "utf-8", "newline": newline}
        with os.fdopen(fd, **mode) as fh:
            write(fh)
            # mkstemp creates 0600; give the file the mode an ordinary open() would have (by its
            # descriptor: the name could be swapped for a link in between)
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fh.fileno(), 0o666 & ~umask)
        # a rename replaces a symbolic link at `path` instead of writing where it points
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
