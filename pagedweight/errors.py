"""Errors a user can act on. Each message names the file, the field and what is allowed."""

from __future__ import annotations

import typing

from pydantic import BaseModel, ValidationError


class PagedWeightError(Exception):
    """Base of every error the project raises on purpose; CLIs print it without a traceback."""


class SpecError(PagedWeightError):
    """A model, GPU or precision description is unknown or malformed."""


class ScenarioError(PagedWeightError):
    """A scenario file is malformed or asks for something impossible."""


class PoolError(PagedWeightError):
    """Misuse of the page pool: double free, wrong owner, unknown page."""


class PoolExhausted(PagedWeightError):
    """Not enough free pages for an allocation (a normal event the scheduler handles)."""


def _allowed_fields(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """Field names allowed at ``loc`` (the parent of an unknown key), walking nested models."""
    cls = model
    for part in loc:
        if cls is None or isinstance(part, int):
            continue
        field = cls.model_fields.get(str(part))
        if field is None:
            return []
        cls = _model_in(field.annotation)
    return sorted(cls.model_fields) if cls is not None else []


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def format_validation_error(err: ValidationError, source: str, model: type[BaseModel] | None = None) -> str:
    """Turn pydantic's error list into lines of ``file: key.path: what is wrong``."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in loc) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            allowed = _allowed_fields(model, loc[:-1])
            msg = "unknown key" + (f"; allowed keys here: {', '.join(allowed)}" if allowed else "")
        elif e["type"] == "literal_error" or e["type"] == "union_tag_invalid":
            msg = msg.replace("Input should be", "must be one of").replace("Input tag", "kind")
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        got = e.get("input")
        if e["type"] not in ("missing", "extra_forbidden") and not isinstance(got, dict | list):
            msg += f" (got {got!r})"
        lines.append(f"{source}: {path}: {msg}")
    return "\n".join(lines)
