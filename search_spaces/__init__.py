"""Declarative search spaces for the tuner (issue 4)."""
