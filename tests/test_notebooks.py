"""Every notebook in notebooks/ runs top to bottom with a real Jupyter kernel (nbclient +
ipykernel), as a user would run it: a cell that raises, or an assertion inside a notebook that
fails, fails this test. The notebooks keep their time limits small so that all of them together
run in about a minute on CI's two cores; they write their files to temporary directories.
Committed notebooks carry no outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS][:3] == ["01_quickstart.ipynb", "02_pareto.ipynb", "03_custom_device.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # outputs are not committed
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip the outputs"
    # the kernel's temporary directories land under pytest's, and its cwd is not the repository
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert images, f"{path.name} shows no plot"
