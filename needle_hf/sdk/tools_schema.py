"""Tool schemas from Python: the `tool` decorator, `Field`, `build_schema` and `pydantic_schema`.

A tool is described to Needle as ``{"name", "description", "parameters"}`` (the form the chat
template writes inside ``<tools>``). The schema each builder yields is the one the reference SDK
(`cactus-needle` 2.0.15, `needle.agent.tools`) yields for the same input, key order included,
because the schema text is part of the prompt the model was trained on.

Functions (`build_schema`):
  - parameters in signature order; ``self``/``cls``, ``*args`` and ``**kwargs`` are left out.
  - annotation to JSON type: ``str``/``int``/``float``/``bool``/``list``/``dict`` map to
    string/integer/number/boolean/array/object; no annotation, ``None`` or any other class is
    ``"string"``; an `Enum` is the JSON type of its first value plus ``enum``; ``Literal[...]`` the
    same over its values; ``list[X]`` is an array of X (``items`` string when bare); ``dict[...]``
    is an object; ``Annotated[X, ...]`` is X; a union is its first non-None member (``int | str``
    is integer); a pydantic model is its `pydantic_schema` parameters.
  - description: the docstring's lines up to an ``Args:``/``Arguments:``/``Parameters:``/
    ``Params:`` header, stripped and joined by single spaces; each indented ``name (type): text``
    line below the header describes that parameter (unless the type already carries one).
  - `Field` constraints come from the default (``x: int = Field(ge=0)``) or from ``Annotated``
    metadata (also inside ``Optional[...]``), and are written after the description.
  - required: parameters without a default (a `Field` default counts) whose type is not Optional.

transformers' `get_json_schema` differs (it wants a docstring for every argument, writes
``nullable``, keeps every union member and puts enum choices from the docstring): Needle's
prompt follows the reference, so these builders do.

A `Field` of the reference SDK (`needle.Field`) works wherever ours does, and a function already
decorated by `needle.tool` keeps the schema that decorator attached.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from typing import Any, Callable

_JSON_TYPE_OF = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_UNIONS = (typing.Union, types.UnionType)
_DOC_SECTION_HEADERS = ("args:", "arguments:", "parameters:", "params:")
# "    name (type): text" under a header; the type in parentheses is optional and ignored.
_DOC_ARGUMENT = re.compile(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)")
#: The attribute a decorated function carries its schema in (the reference's name, so either SDK reads it).
SCHEMA_ATTRIBUTE = "_needle_tool"


class _Unset:
    def __repr__(self):
        return "<unset>"


UNSET = _Unset()

# Field keyword -> JSON schema key, in the order the keys are written.
_FIELD_KEYS = (
    ("description", "description"), ("enum", "enum"), ("ge", "minimum"), ("le", "maximum"),
    ("gt", "exclusiveMinimum"), ("lt", "exclusiveMaximum"), ("multiple_of", "multipleOf"),
    ("min_length", "minLength"), ("max_length", "maxLength"), ("pattern", "pattern"), ("format", "format"),
    ("min_items", "minItems"), ("max_items", "maxItems"), ("unique_items", "uniqueItems"),
)


class Field:
    """Per-argument description and constraints, written into the argument's JSON schema.

    Use as a default (``level: int = Field(ge=0, le=100)``) or as ``Annotated`` metadata
    (``level: Annotated[int, Field(ge=0, le=100)]``). ``default`` makes the argument optional.
    Keywords map to JSON schema keys: ``ge``/``le`` -> minimum/maximum, ``gt``/``lt`` ->
    exclusiveMinimum/exclusiveMaximum, ``min_length``/``max_length``/``min_items``/``max_items``/
    ``unique_items``/``multiple_of`` -> their camelCase keys, ``enum``, ``const``, ``pattern``,
    ``format`` (``"date"``/``"date-time"`` also turn on the year check of `needle_hf.sdk.validation`).
    """

    def __init__(self, default: Any = UNSET, *, description=None, enum=None, const: Any = UNSET, ge=None, le=None,
                 gt=None, lt=None, multiple_of=None, min_length=None, max_length=None, pattern=None, format=None,
                 min_items=None, max_items=None, unique_items=None):
        self.default = default
        self.description, self.enum, self.const = description, enum, const
        self.ge, self.le, self.gt, self.lt, self.multiple_of = ge, le, gt, lt, multiple_of
        self.min_length, self.max_length, self.pattern, self.format = min_length, max_length, pattern, format
        self.min_items, self.max_items, self.unique_items = min_items, max_items, unique_items

    def has_default(self) -> bool:
        return self.default is not UNSET

    def apply(self, schema: dict) -> dict:
        """Write this field's keys into ``schema`` (in place) and return it."""
        for keyword, key in _FIELD_KEYS:
            value = getattr(self, keyword)
            if value is not None:
                schema[key] = list(value) if key == "enum" else value
        if self.const is not UNSET:
            schema["const"] = self.const
        return schema

    def __repr__(self):
        set_keys = {keyword: getattr(self, keyword) for keyword, _ in _FIELD_KEYS if getattr(self, keyword) is not None}
        return f"Field({self.default!r}, {set_keys})" if self.has_default() else f"Field({set_keys})"


def is_field(value: Any) -> bool:
    """Ours or the reference SDK's `Field` (same keywords, `apply` and `has_default`)."""
    if isinstance(value, Field):
        return True
    kind = type(value)
    return kind.__name__ == "Field" and kind.__module__.split(".")[0] == "needle" and hasattr(value, "apply")


def is_pydantic_model(obj: Any) -> bool:
    """A pydantic model class (v1 or v2), recognised without importing pydantic."""
    return isinstance(obj, type) and any(
        base.__name__ == "BaseModel" and base.__module__.startswith("pydantic") for base in obj.__mro__)


def _is_optional(annotation) -> bool:
    return typing.get_origin(annotation) in _UNIONS and type(None) in typing.get_args(annotation)


def _members(annotation) -> list:
    return [member for member in typing.get_args(annotation) if member is not type(None)]


def _enum_schema(values: list) -> dict:
    first_type = _JSON_TYPE_OF.get(type(values[0]), "string") if values else "string"
    return {"type": first_type, "enum": values}


def json_type(annotation) -> dict:
    """The JSON schema of one parameter's annotation (see the module docstring for the mapping)."""
    if annotation is inspect.Parameter.empty or annotation is None:
        return {"type": "string"}
    origin = typing.get_origin(annotation)
    if origin is None:
        if annotation in _JSON_TYPE_OF:
            return {"type": _JSON_TYPE_OF[annotation]}
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            return _enum_schema([member.value for member in annotation])
        if is_pydantic_model(annotation):
            return pydantic_schema(annotation)["parameters"]
        return {"type": "string"}
    arguments = typing.get_args(annotation)
    if origin is typing.Annotated:
        return json_type(arguments[0])
    if origin is typing.Literal:
        return _enum_schema(list(arguments))
    if origin is list:
        return {"type": "array", "items": json_type(arguments[0]) if arguments else {"type": "string"}}
    if origin is dict:
        return {"type": "object"}
    if origin in _UNIONS and _members(annotation):
        return json_type(_members(annotation)[0])
    return {"type": "string"}


def _field_of(annotation, default):
    """The `Field` governing a parameter: its default, else Annotated metadata (looking inside Optional)."""
    if is_field(default):
        return default
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return next((meta for meta in typing.get_args(annotation)[1:] if is_field(meta)), None)
    if origin in _UNIONS and len(_members(annotation)) == 1:
        return _field_of(_members(annotation)[0], None)
    return None


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) of a Google-style docstring."""
    if not doc:
        return "", {}
    lines = doc.strip("\n").splitlines()
    header = next((i for i, line in enumerate(lines) if line.strip().lower() in _DOC_SECTION_HEADERS), len(lines))
    description = " ".join(line.strip() for line in lines[:header] if line.strip())
    arguments = {}
    for line in lines[header + 1:]:
        match = _DOC_ARGUMENT.match(line)
        if match:
            arguments[match.group(1)] = match.group(2).strip()
    return description, arguments


def build_schema(fn: Callable) -> dict:
    """``{"name", "description"?, "parameters"}`` of a Python function (see the module docstring)."""
    if not callable(fn):
        raise TypeError(f"build_schema: expected a function, got {type(fn).__name__}: {fn!r:.80}")
    if not isinstance(getattr(fn, "__name__", None), str):
        raise TypeError(f"build_schema: a tool is named by its function's __name__, and this "
                        f"{type(fn).__name__} has none ({fn!r:.80}); wrap it in a def, or set __name__")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # unresolvable forward references: fall back to the raw annotations
        hints = {}
    description, argument_docs = parse_docstring(fn.__doc__)
    properties, required = {}, []
    for name, parameter in inspect.signature(fn).parameters.items():
        if name in ("self", "cls") or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = hints.get(name, parameter.annotation)
        schema = json_type(annotation)
        if name in argument_docs and "description" not in schema:
            schema["description"] = argument_docs[name]
        field = _field_of(annotation, parameter.default)
        if field is not None:
            field.apply(schema)
        properties[name] = schema
        has_default = (parameter.default is not parameter.empty and not is_field(parameter.default)) or (
            field is not None and field.has_default())
        if not has_default and not _is_optional(annotation):
            required.append(name)
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    schema = {"name": fn.__name__}
    if description:
        schema["description"] = description
    schema["parameters"] = parameters
    return schema


def pydantic_schema(model: type) -> dict:
    """``{"name", "parameters", "description"?}`` of a pydantic model class (v2 or v1).

    The parameters are the model's JSON schema properties with its ``required`` and ``$defs``
    (``definitions`` in v1); the name is the schema's title; the description the class docstring.
    """
    if not is_pydantic_model(model):
        raise TypeError(f"pydantic_schema: expected a pydantic model class, got {type(model).__name__}: {model!r:.80}")
    raw = model.model_json_schema() if hasattr(model, "model_json_schema") else model.schema()
    parameters = {"type": "object", "properties": raw.get("properties", {})}
    parameters.update({key: raw[key] for key in ("required", "$defs", "definitions") if key in raw})
    schema = {"name": raw.get("title", model.__name__), "parameters": parameters}
    if (model.__doc__ or "").strip():
        schema["description"] = model.__doc__.strip()
    return schema


def tool(fn: Callable) -> Callable:
    """Mark a function as a tool: its schema is built once and attached (the function is unchanged)."""
    setattr(fn, SCHEMA_ATTRIBUTE, build_schema(fn))
    return fn


def tool_schema_of(entry: Any, *, where: str = "tools") -> dict:
    """The schema of one tool entry: a decorated or plain function, a pydantic model or a schema dict.
    ``where`` names the entry in the error for anything else (``tools[2]``, ``schema``)."""
    if is_pydantic_model(entry):
        return pydantic_schema(entry)
    if callable(entry):
        return getattr(entry, SCHEMA_ATTRIBUTE, None) or build_schema(entry)
    if isinstance(entry, dict):
        if entry.get("type") == "function" and isinstance(entry.get("function"), dict):
            return entry["function"]
        return entry
    raise TypeError(
        f"{where}: expected a function, a pydantic model or a schema dict, got {type(entry).__name__}: {entry!r}")


__all__ = ["Field", "build_schema", "is_field", "is_pydantic_model", "json_type", "parse_docstring",
           "pydantic_schema", "tool", "tool_schema_of"]
