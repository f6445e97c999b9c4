"""The package's shape: stages import one way (the import-linter contract in pyproject.toml), no
module imports itself back through others, every stage says what it does, and no module grows
into a second idea."""

from __future__ import annotations

import graphlib
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import poet_opt

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("model", "device", "schedule", "solver", "firmware", "executor", "pareto", "plots")


def _modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(poet_opt.__path__, "poet_opt.")]


def test_layers_contract_holds():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_no_import_cycles_between_modules():
    # grimp reads every import statement, those inside functions too, so a lazy import that
    # closes a circle is caught as well as a top-level one
    graph = grimp.build_graph("poet_opt", include_external_packages=False)
    order = graphlib.TopologicalSorter()
    for module in graph.modules:
        order.add(module, *(m for m in graph.find_modules_directly_imported_by(module) if m != "poet_opt"))
    try:
        order.prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_a_cycle_would_be_found(tmp_path, monkeypatch):
    package = tmp_path / "circle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from circle import b\n")
    (package / "b.py").write_text("from circle import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("circle", cache_dir=None)
    order = graphlib.TopologicalSorter()
    for module in graph.modules:
        order.add(module, *graph.find_modules_directly_imported_by(module))
    with pytest.raises(graphlib.CycleError):
        order.prepare()


def test_every_module_imports_on_its_own():
    for name in _modules():
        importlib.import_module(name)


def test_each_stage_says_what_it_does():
    for stage in STAGES:
        doc = importlib.import_module(f"poet_opt.{stage}").__doc__ or ""
        assert doc.split(":")[0].strip(), stage
        assert len(doc.split()) >= 8, f"poet_opt.{stage} needs a sentence on what the stage does"


def test_top_level_is_small_and_modules_stay_one_idea():
    top = [p.name for p in (ROOT / "poet_opt").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 5, top
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "poet_opt").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 700}
    assert not long, f"modules over 700 lines: {long}"


def test_public_entry_points_from_the_package_top():
    from poet_opt import build_model, load_profile, plot_front, plot_timeline, solve, summary_text, sweep

    schedule = solve(build_model("mlp"), load_profile("rpi4"), ram="200KB", time_limit=10)
    assert "energy" in summary_text(schedule)
    assert callable(sweep) and callable(plot_front) and callable(plot_timeline)
    with pytest.raises(AttributeError):
        poet_opt.no_such_thing  # noqa: B018


def test_no_module_imports_another_modules_private_names():
    """``from poet_opt.x import _name`` couples a module to another's insides (issue 27: the strip
    code generator imported the writer's _Writer, _float, _ident); what is shared is public."""
    import ast

    found = []
    for path in (ROOT / "poet_opt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("poet_opt"):
                found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found


def test_docs_architecture_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT / "poet_opt")) for p in (ROOT / "poet_opt").rglob("*.py")
               if p.name != "__init__.py" and "firmware/board" not in str(p)
               and str(p.relative_to(ROOT / "poet_opt")) not in text
               and not (p.parent == ROOT / "poet_opt" and f"`{p.name}`" in text)]
    assert not missing, f"docs/architecture.md, 'Where each concept lives', lacks {missing}"
