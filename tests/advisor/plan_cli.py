"""`advisor` run as a user runs it, for the planner's CLI tests: a wide terminal, the checkout on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def advisor(*args: str) -> subprocess.CompletedProcess:
    """`python -m advisor.cli ARGS` in the checkout; fails the test on a traceback."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc
