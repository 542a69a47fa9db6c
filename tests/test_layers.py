"""The layers: the store and the search spaces import nothing from `probes` (the trial runner), and
`advisor` imports it only where it runs trials and benches."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The advisor modules that run trials or benches, and so may import probes.
PROBES_ALLOWED = {
    "advisor/cli.py",  # `advisor trial` runs one trial; `advisor probe --bench` runs the machine bench
    "advisor/tune/trainable.py",  # the tuner's trainable runs each trial; the tuner starts the trial fork server here
}


def _imports_probes(path: Path) -> list[str]:
    """`import probes...` and `from probes... import` statements in `path`, as 'file:line'."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name == "probes" or name.startswith("probes.") for name in names):
            hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return hits


def _python_files(*folders: str) -> list[Path]:
    files = [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]
    assert files, folders
    return files


def test_store_and_search_spaces_import_no_probes():
    hits = [hit for path in _python_files("advisor/store", "search_spaces") for hit in _imports_probes(path)]
    assert hits == []


def test_advisor_imports_probes_only_where_it_runs_trials():
    hits = [hit for path in _python_files("advisor") if str(path.relative_to(ROOT)) not in PROBES_ALLOWED
            for hit in _imports_probes(path)]
    assert hits == []


def test_the_allowed_modules_exist():
    assert all((ROOT / name).is_file() for name in PROBES_ALLOWED)


def test_the_check_sees_every_form_of_import(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    forms = ["import probes", "import probes.runner as r", "from probes import run_trial",
             "from probes.runner import run_trial", "def f():\n    from probes.bench import run_bench"]
    for i, form in enumerate(forms):
        (tmp_path / f"m{i}.py").write_text(form + "\n")
    (tmp_path / "ok.py").write_text("import probesx\nfrom advisor.trial import TrainingConfig\nfrom . import probes\n")
    assert [len(_imports_probes(p)) for p in sorted(tmp_path.glob("*.py"))] == [1, 1, 1, 1, 1, 0]
