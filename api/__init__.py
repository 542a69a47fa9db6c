"""The HTTP API (issue 5)."""
