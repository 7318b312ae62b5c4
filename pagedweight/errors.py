"""Errors a user can act on. Each message names the file, the field and what is allowed."""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel, ValidationError


class PagedWeightError(Exception):
    """Base of every error the project raises on purpose; CLIs print it without a traceback."""


class SpecError(PagedWeightError):
    """A model, GPU or precision description is unknown or malformed."""


class ScenarioError(PagedWeightError):
    """A scenario file is malformed or asks for something impossible."""


class MissingFileError(ScenarioError):
    """A file a scenario names (its trace, lengths, latency or importance table) is not there."""


class ConfigError(PagedWeightError, ValueError):
    """A setting outside its allowed values. A ``ValueError`` too, so that pydantic validators
    raising it report the field, and a CLI prints it without a traceback."""


class PoolError(PagedWeightError):
    """Misuse of the page pool: double free, wrong owner, unknown page."""


class PoolExhausted(PagedWeightError):
    """Not enough free pages for an allocation (a normal event the scheduler handles)."""


def _allowed_fields(model: type[BaseModel] | None, loc: tuple, raw: object = None) -> list[str]:
    """Field names allowed at ``loc`` (the parent of an unknown key), walking nested models;
    in a tagged union the member is the one whose ``kind`` matches the raw input."""
    cls, node = model, raw
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
        if cls is None or isinstance(part, int):
            continue
        field = cls.model_fields.get(str(part))
        if field is None:
            return []
        cls = _model_in(field.annotation, node.get("kind") if isinstance(node, dict) else None)
    return sorted(cls.model_fields) if cls is not None else []


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _model_in(annotation, kind: object = None) -> type[BaseModel] | None:
    candidates = _models_in(annotation)
    for cls in candidates:
        kind_field = cls.model_fields.get("kind")
        if kind is not None and kind_field is not None and kind in typing.get_args(kind_field.annotation):
            return cls
    return candidates[0] if candidates else None


def _user_path(loc: tuple, raw: object) -> tuple:
    """The key path as the user wrote it: pydantic adds the ``kind:`` tag of a tagged union to
    ``loc`` (``workload.synthetic.arrival``); drop those parts by walking the raw input."""
    out, node = [], raw
    for part in loc:
        if isinstance(node, dict) and part not in node and node.get("kind") == part:
            continue
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(out)


def format_validation_error(
    err: ValidationError, source: str, model: type[BaseModel] | None = None, raw: object = None
) -> str:
    """Turn pydantic's error list into lines of ``file: key.path: what is wrong``. Give the
    ``raw`` input to get key paths exactly as written in the file."""
    lines = []
    for e in err.errors():
        full_loc = tuple(e["loc"])
        loc = _user_path(full_loc, raw) if raw is not None else full_loc
        path = ".".join(str(p) for p in loc) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            allowed = _allowed_fields(model, loc[:-1], raw)
            msg = "unknown key" + (f"; allowed keys here: {', '.join(allowed)}" if allowed else "")
        elif e["type"] == "union_tag_invalid":
            ctx = e.get("ctx", {})
            path = f"{path}.{ctx.get('discriminator', 'kind').strip(chr(39))}"
            msg = f"{ctx.get('tag')!r} is not allowed; allowed: {ctx.get('expected_tags')}"
        elif e["type"] == "literal_error":
            msg = msg.replace("Input should be", "must be one of")
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        got = e.get("input")
        if e["type"] not in ("missing", "extra_forbidden") and not isinstance(got, dict | list):
            msg += f" (got {got!r})"
        lines.append(f"{source}: {path}: {msg}")
    return "\n".join(lines)


class TraceError(PagedWeightError):
    """A trace file is missing, malformed or empty; the message names the file, line and column."""


class ImportanceError(PagedWeightError):
    """An importance table is malformed: missing experts, bad values, unknown columns."""


class AllocationError(PagedWeightError):
    """An allocation cannot be made: a budget below the minimum, a pin outside the ladder."""


def read_yaml_mapping(path, error: type[PagedWeightError], allowed: list[str] | tuple[str, ...]) -> dict:
    """``yaml.safe_load`` of a file that must hold a mapping; every failure is ``error`` naming
    the file (and, for a non-mapping, the keys allowed at the top level)."""
    import yaml  # only the loaders need it

    src = str(path)
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise error(f"file {src} does not exist") from None
    except yaml.YAMLError as e:
        raise error(f"{src}: not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise error(f"{src}: not a text (UTF-8) file") from None
    if not isinstance(raw, dict):
        raise error(f"{src}: expected a mapping at the top level; allowed keys: {', '.join(allowed)}")
    return raw


def read_yaml_model(path, model, error: type[PagedWeightError], what: str):
    """A YAML file validated as the pydantic ``model``: (the model, the raw mapping). A missing
    file, bad YAML or a field that fails validation is one ``error`` naming ``what`` (e.g.
    "sweep file"), the file and the field."""
    from pydantic import ValidationError

    src = str(path)
    if not Path(path).is_file():
        raise error(f"{what} {src} does not exist")
    raw = read_yaml_mapping(path, error, list(model.model_fields))
    try:
        return model.model_validate(raw), raw
    except ValidationError as e:
        raise error(format_validation_error(e, src, model, raw)) from None
