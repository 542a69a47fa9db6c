"""Declarative search spaces for the tuner: knob domains and the conditions between knobs (YAML
validated by pydantic), evaluated against a target for Optuna (`suggest`) or as a `grid`, and
pruned by the memory estimate before anything runs (`feasibility`, `OomFrontier`)."""

from search_spaces.context import SpaceContext
from search_spaces.prune import Feasibility, OomFrontier, feasibility
from search_spaces.registry import SPACES, get_space, load_space, parse_space
from search_spaces.sample import apply_fixes, baseline, grid, iter_grid, parse_fixes, suggest
from search_spaces.spec import KNOBS, ORDER, Choices, Condition, Fixed, IntRange, SearchSpace

__all__ = [
    "KNOBS", "ORDER", "SPACES", "Choices", "Condition", "Feasibility", "Fixed", "IntRange", "OomFrontier",
    "SearchSpace", "SpaceContext", "apply_fixes", "baseline", "feasibility", "get_space", "grid", "iter_grid",
    "load_space", "parse_fixes", "parse_space", "suggest",
]
