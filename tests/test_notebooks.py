"""Every notebook runs top to bottom (its cells assert what they show)."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_tour.ipynb", "02_mlp_block.ipynb", "03_gpu_workstation.ipynb", "04_transformer_layer.ipynb",
            "05_train.ipynb"} <= names, sorted(names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    for cell in nb.cells:  # a chart shows as a picture, not as "<Figure size 1000x370 with 1 Axes>"
        if cell.cell_type == "code" and ".plot(" in cell.source:
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.source
