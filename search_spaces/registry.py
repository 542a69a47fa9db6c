"""The shipped spaces by name (`SPACES`, `get_space`) and `load_space` for a user's YAML file."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from advisor.errors import SpecError
from search_spaces.spec import SearchSpace

_DIR = resources.files("search_spaces") / "presets"
# name -> the packaged YAML file; `tiny` is the registry-wide test entry (STYLE.md).
SPACES: dict[str, Any] = {name: _DIR / f"{name}.yaml" for name in ("quick", "default", "exhaustive", "tiny")}


def _describe(exc: ValidationError) -> str:
    """Each problem as `field.path: what was wrong` (pydantic's own wording, without its boilerplate)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; allowed: {', '.join(_fields_at(err['loc']))}"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def _fields_at(loc: tuple) -> list[str]:
    from search_spaces.spec import Condition

    model = Condition if loc and loc[0] == "conditions" else SearchSpace
    return list(model.model_fields)


def parse_space(text: str, source: str) -> SearchSpace:
    """A SearchSpace from YAML text; SpecError naming `source` and the field that is wrong."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"space {source}: not valid YAML: {str(exc).splitlines()[0]} "
                        f"{getattr(exc, 'problem_mark', '') or ''}".strip()) from exc
    if not isinstance(data, dict):
        raise SpecError(f"space {source}: expected a mapping with name, knobs and conditions, "
                        f"got {type(data).__name__}")
    try:
        return SearchSpace.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"space {source}: {_describe(exc)}") from exc


@lru_cache(maxsize=None)
def get_space(name: str) -> SearchSpace:
    """The shipped space called `name`; SpecError listing the valid names if there is none."""
    if name not in SPACES:
        raise SpecError(f"unknown search space {name!r}; valid: {', '.join(SPACES)} (or a path to a YAML file)")
    return parse_space(SPACES[name].read_text(), name)


def load_space(path_or_name: str | Path) -> SearchSpace:
    """A shipped space by name, or a user's YAML file by path (`--space`)."""
    text = str(path_or_name)
    if isinstance(path_or_name, Path) or text.endswith((".yaml", ".yml")) or "/" in text:
        path = Path(path_or_name)
        if not path.is_file():
            raise SpecError(f"space file {path} does not exist; shipped spaces: {', '.join(SPACES)}")
        return parse_space(path.read_text(), str(path))
    return get_space(text)
