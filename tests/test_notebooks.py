"""Every notebook runs top to bottom on a fresh kernel (so none of them rots)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(REPO_ROOT, "notebooks")
NOTEBOOKS = sorted(n for n in os.listdir(NOTEBOOK_DIR) if n.endswith(".ipynb"))


# a line each notebook prints when it got to its point
MARKERS = {"01_generate.ipynb": "tokens in", "02_sharding.ipynb": "V4-Flash weights per device"}


def test_there_are_notebooks():
    assert NOTEBOOKS == sorted(MARKERS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, monkeypatch):
    # the kernel is a fresh process: it must import this checkout, not whatever an earlier
    # `pip install -e` of another path left in site-packages
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": NOTEBOOK_DIR}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(MARKERS[name] in o.get("text", "") for o in outputs)
