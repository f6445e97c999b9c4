"""Run every command of README.md and docs/*.md, the long ones too: what tests/test_docs.py leaves out.

tests/test_docs.py runs each document's commands in a scratch checkout but skips those tagged
`# long` (minutes) and `# cluster` (a Dask cluster). This script runs all of them, in the same
scratch checkouts and with the same checks, starting a local Dask scheduler and worker for the
cluster examples (`HOST` becomes 127.0.0.1). Commands tagged `# on the board` or `# interactive`
are still left out. By hand, not in CI: it takes about ten minutes, plus hours for
`docs/baselines.md`'s full benchmark (leave that document out with --skip docs/baselines.md).

    .venv/bin/python benchmarks/docs_check.py                          # everything
    .venv/bin/python benchmarks/docs_check.py README.md docs/pareto.md # some documents
    .venv/bin/python benchmarks/docs_check.py --only-tagged            # just what the suite skips

Prints one line per command with its time; exits 1 if any command failed or printed something
other than what its document shows.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_docs as td

RUN_HERE = ("long", "cluster")


def run_doc(doc: Path, only_tagged: bool) -> list[str]:
    failures = []
    background: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix=f"docs-check-{doc.stem}-") as tmp:
        cwd = td.scratch_checkout(Path(tmp))
        done: set = set()
        try:
            for block in td.blocks(doc):
                where = f"{doc.relative_to(ROOT)}:{block.line}"
                if block.lang in ("sh", "console"):
                    for cmd in td.commands(block):
                        if cmd.tag in RUN_HERE:
                            text = cmd.text.replace("HOST", "127.0.0.1")
                            if text.endswith("&"):  # a scheduler or worker: keep it running
                                argv = shlex.split(text[:-1])
                                background.append(subprocess.Popen(argv, cwd=cwd, env=td.environment(cwd),
                                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                                time.sleep(5)
                                print(f"  {where}: started {text[:-1].strip()}")
                                continue
                            cmd = td.Command(text, "", cmd.expected)  # untagged now: run_command runs it
                            shown = True
                        else:  # untagged commands run too: a long one may need what they wrote
                            shown = not only_tagged
                        try:
                            outcome = td.run_command(cmd, cwd, done, where, slow_s=float("inf"), timeout=6 * 3600)
                            if shown:
                                print(f"  {where}: {cmd.text[:80]}: {outcome}")
                        except AssertionError as exc:
                            failures.append(str(exc))
                            print(f"  {where}: {cmd.text[:80]}: FAILED\n{exc}")
                elif block.lang == "python":
                    first = block.body.lstrip().splitlines()[0]
                    tag = td.Command("", td.split_comment(first)[1] if first.startswith("#") else "").tag
                    if tag not in (None, *RUN_HERE):
                        continue
                    (cwd / "block.py").write_text(block.body + "\n")
                    result, seconds = td.run([sys.executable, "block.py"], cwd, timeout=6 * 3600)
                    if result.returncode:
                        failures.append(f"{where}: python block: {result.stderr}")
                    print(f"  {where}: python block{' (' + tag + ')' if tag else ''}: "
                          f"{'FAILED' if result.returncode else 'ran'} in {seconds:.1f} s")
        finally:
            for proc in background:
                proc.terminate()
                proc.wait(timeout=30)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="*", help="documents (default: README.md and docs/*.md)")
    parser.add_argument("--skip", action="append", default=[], help="leave this document out (repeatable)")
    parser.add_argument("--only-tagged", action="store_true", help="print only the long and cluster commands")
    args = parser.parse_args()
    docs = [ROOT / d for d in args.docs] if args.docs else td.documents()
    docs = [d for d in docs if d.relative_to(ROOT).as_posix() not in args.skip]
    failures = []
    for doc in docs:
        print(doc.relative_to(ROOT))
        failures += run_doc(doc, args.only_tagged)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
