"""Constants and helpers the service's tests import by name. They live here, not in conftest.py:
`from conftest import ...` finds whichever conftest.py comes first on sys.path, and with
tests/search_spaces collected in the same run that is the wrong one."""

from __future__ import annotations

import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
