"""Tool schemas (`needle_hf.sdk.tools_schema`) equal the reference SDK's (`needle.agent.tools`) for the same input.

Function signatures are generated (Hypothesis): parameter types from a pool covering every branch
of the mapping (plain types, Literal, Enum, Optional, unions, list[X], dict, Annotated, pydantic
models), defaults, `Field` constraints as defaults or Annotated metadata, and Google-style
docstrings. Each function is built twice, once with each SDK's `Field`, and the schemas are compared
as JSON text, so key order counts (the schema is prompt text).
"""

from __future__ import annotations

import enum
import inspect
import json
import os
import typing
from typing import Annotated, Literal, Optional

os.environ.setdefault("NEEDLE_TELEMETRY", "0")  # the reference SDK's opt-out, before it is imported
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import BaseModel  # noqa: E402

import needle  # noqa: E402
from needle.agent import tools as reference_tools  # noqa: E402

import needle_hf  # noqa: E402
from needle_hf.sdk.tools_schema import tool_schema_of  # noqa: E402

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 3


class Address(BaseModel):
    """A postal address."""

    street: str
    zip_code: Optional[int] = None


def dumped(schema: dict) -> str:
    return json.dumps(schema)  # key order kept: it is part of the prompt


# Annotation pool: (annotation factory taking a Field or None, optional?)
def _annotations(field):
    plain = [str, int, float, bool, list, dict, None, bytes, Color, Level, Address,
             Literal["a", "b"], Literal[1, 2, 3], Literal[True], list[int], list[Color], typing.List[str],
             dict[str, int], Optional[int], Optional[Literal["x", "y"]], int | None, typing.Union[int, str],
             str | int | None, list[Optional[int]], tuple[int, int], typing.Any]
    if field is not None:
        plain += [Annotated[int, field], Annotated[Optional[int], field], Optional[Annotated[str, field]],
                  Annotated[list[str], "meta", field]]
    return plain


FIELD_KEYWORDS = st.fixed_dictionaries({}, optional={
    "description": st.text(max_size=12), "ge": st.integers(-5, 5), "le": st.integers(5, 50),
    "gt": st.floats(-1, 1, allow_nan=False), "lt": st.integers(50, 60), "multiple_of": st.sampled_from([1, 2, 0.5]),
    "min_length": st.integers(0, 3), "max_length": st.integers(4, 80), "pattern": st.sampled_from(["^a", r"\d+"]),
    "format": st.sampled_from(["date", "date-time", "email"]), "min_items": st.integers(0, 2),
    "max_items": st.integers(3, 9), "unique_items": st.booleans(), "enum": st.lists(st.integers(0, 9), max_size=3),
    "const": st.sampled_from([None, 0, "k"]), "default": st.sampled_from([None, 1, "d"]),
})

PARAMETER = st.fixed_dictionaries({
    "annotation": st.integers(0, 40),  # index into the pool (wrapped)
    "field": st.one_of(st.none(), FIELD_KEYWORDS),
    "field_as_default": st.booleans(),
    "default": st.sampled_from([inspect.Parameter.empty, inspect.Parameter.empty, None, 0, "x", [1]]),
    "kind": st.sampled_from(["plain", "plain", "plain", "unannotated", "var_args", "var_kwargs", "self"]),
    "documented": st.sampled_from([None, "plain", "typed"]),
})
SIGNATURE = st.fixed_dictionaries({
    "name": st.from_regex(r"[a-z][a-z_0-9]{0,10}", fullmatch=True),
    "summary": st.lists(st.sampled_from(["Set the alarm.", "  Indented line", "", "Second sentence."]), max_size=3),
    "header": st.sampled_from(["Args:", "Arguments:", "Parameters:", "params:", "Returns:", None]),
    "parameters": st.lists(PARAMETER, max_size=6),
})


def make_function(spec: dict, field_class):
    """A function with the generated signature, annotations and docstring (built, not exec'd)."""
    parameters, annotations, doc_lines = [], {}, []
    seen_kinds = set()
    for index, item in enumerate(spec["parameters"]):
        name = f"p{index}"
        kind = item["kind"]
        field = None if item["field"] is None else field_class(
            **{k: v for k, v in item["field"].items()}) if "default" not in item["field"] else field_class(
            item["field"]["default"], **{k: v for k, v in item["field"].items() if k != "default"})
        pool = _annotations(None if item["field_as_default"] else field)
        annotation = pool[item["annotation"] % len(pool)]
        default = field if (field is not None and item["field_as_default"]) else item["default"]
        if kind in ("var_args", "var_kwargs"):
            if kind in seen_kinds:
                continue
            seen_kinds.add(kind)
            parameters.append(inspect.Parameter(name, inspect.Parameter.VAR_POSITIONAL if kind == "var_args"
                                                else inspect.Parameter.VAR_KEYWORD))
            continue
        if kind == "self":
            name = "self" if index == 0 else name
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=inspect.Parameter.empty if kind == "unannotated" else annotation))
        if kind != "unannotated":
            annotations[name] = annotation
        if item["documented"] == "plain":
            doc_lines.append(f"    {name}: about {name}.")
        elif item["documented"] == "typed":
            doc_lines.append(f"    {name} (int): typed {name}")
    # keyword-only parameters after VAR_KEYWORD are invalid; order them as Python requires
    order = {inspect.Parameter.VAR_POSITIONAL: 0, inspect.Parameter.KEYWORD_ONLY: 1, inspect.Parameter.VAR_KEYWORD: 2}
    parameters.sort(key=lambda p: order[p.kind])

    def function(*args, **kwargs):
        return kwargs

    function.__name__ = spec["name"]
    function.__signature__ = inspect.Signature(parameters)
    function.__annotations__ = annotations
    doc = "\n".join(spec["summary"])
    if spec["header"]:
        doc += f"\n\n{spec['header']}\n" + "\n".join(doc_lines)
    function.__doc__ = doc or None
    return function


@settings(max_examples=300, deadline=None)
@given(SIGNATURE)
def test_generated_signatures_give_the_reference_schema(spec):
    expected = reference_tools.build_schema(make_function(spec, needle.Field))
    assert dumped(needle_hf.build_schema(make_function(spec, needle_hf.Field))) == dumped(expected)
    # The reference's own Field works unchanged in ours.
    assert dumped(needle_hf.build_schema(make_function(spec, needle.Field))) == dumped(expected)


@pytest.mark.parametrize("name", ["data_capture", "kitchen_appliance", "media_player", "productivity",
                                  "smart_home", "wearable"])
def test_the_reference_environments_tools_give_the_reference_schema(name):
    import importlib

    module = importlib.import_module(f"needle.environments.{name}")
    for function in module.TOOLS:
        undecorated = reference_tools.build_schema(function)
        assert dumped(needle_hf.build_schema(function)) == dumped(undecorated)
        assert tool_schema_of(function) is function._needle_tool  # the reference's decoration is kept


class Invoice(BaseModel):
    """An invoice."""

    vendor: str
    total: float
    due: Optional[str] = None
    lines: list[Address] = []
    color: Color = Color.RED


class Bare(BaseModel):
    count: int


@pytest.mark.parametrize("model", [Invoice, Bare, Address])
def test_pydantic_models_give_the_reference_schema(model):
    assert dumped(needle_hf.pydantic_schema(model)) == dumped(reference_tools.pydantic_schema(model))
    assert tool_schema_of(model) == reference_tools.pydantic_schema(model)


def test_decorator_attaches_the_schema_the_reference_reads():
    @needle_hf.tool
    def set_volume(level: Annotated[int, needle_hf.Field(ge=0, le=100)], room: Literal["kitchen", "study"] = "study"):
        """Set the volume.

        Args:
            level: Volume from 0 to 100.
        """

    # The reference SDK's agent reads this attribute before building a schema itself, so our decorated
    # functions (and our Field, which its builder does not know) work there too.
    assert set_volume._needle_tool == {
        "name": "set_volume", "description": "Set the volume.",
        "parameters": {"type": "object", "properties": {
            "level": {"type": "integer", "description": "Volume from 0 to 100.", "minimum": 0, "maximum": 100},
            "room": {"type": "string", "enum": ["kitchen", "study"]}}, "required": ["level"]}}
    assert set_volume(level=3) is None  # the function itself is unchanged


def test_schema_dicts_and_json_strings_are_taken_as_they_are():
    from needle_hf.sdk.needle import resolve_tools

    schema = {"name": "ping", "parameters": {"type": "object", "properties": {}}}
    assert resolve_tools([schema]) == ([schema], {})
    assert resolve_tools([{"type": "function", "function": schema}])[0] == [schema]
    assert resolve_tools(json.dumps([schema]))[0] == [schema]
    with pytest.raises(ValueError, match="JSON list of tool schemas"):
        resolve_tools("[not json")
    with pytest.raises(TypeError, match=r"tools\[1\]: expected a function, a pydantic model or a schema dict, got int"):
        resolve_tools([schema, 42])
    with pytest.raises(TypeError, match=r"tools\[0\]: expected .*, got str"):  # JSON strings: the whole list only
        resolve_tools([json.dumps(schema)])
    with pytest.raises(ValueError, match=r"tools\[0\]: a tool schema needs a non-empty string 'name'"):
        resolve_tools([{"parameters": {}}])


def test_what_is_no_tool_gets_a_clear_error():
    import functools

    def scale(value: int, factor: int = 2) -> int:
        """Scale a value."""
        return value * factor

    with pytest.raises(TypeError, match="build_schema: expected a function, got int"):
        needle_hf.tool(5)
    with pytest.raises(TypeError, match="build_schema: a tool is named by its function's __name__, and this partial"):
        needle_hf.build_schema(functools.partial(scale, factor=3))
    with pytest.raises(TypeError, match="pydantic_schema: expected a pydantic model class, got dict"):
        needle_hf.pydantic_schema({"name": "x"})
