"""Logging set-up shared by the CLI and the API."""

from __future__ import annotations

import logging


def setup_logging(level: str = "WARNING") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
