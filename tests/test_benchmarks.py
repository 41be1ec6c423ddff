"""The benchmark script runs end to end on tiny lengths and writes its table, JSON and plot (it is not a test of
speed: speed targets are checked by running it, see the README)."""

import json
import subprocess
import sys
from pathlib import Path

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


def test_notebook_is_valid_and_its_cells_compile():
    notebook = json.loads((ROOT / "notebooks" / "walkthrough.ipynb").read_text())
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert cells
    for cell in cells:
        compile("".join(cell["source"]), "walkthrough.ipynb", "exec")


def test_recovery_notebook_executes_and_shows_its_tables(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("RECOVERY_PLOTS", str(tmp_path))
    notebook = nbformat.read(ROOT / "notebooks" / "recovery.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    text = "".join(str(output.get("data", {}).get("text/markdown", "")) for cell in notebook.cells
                   for output in cell.get("outputs", []))
    assert "| arm | cosine |" in text and "| arm | ppl 512 |" in text
    assert (tmp_path / "minilm_recovery.png").stat().st_size > 5_000
