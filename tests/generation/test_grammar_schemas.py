"""Grammar = parser: every answer the tool-call grammar admits parses (`parse_assistant_turn`) and
satisfies the tool's schema; the schemas pydantic v2 writes for tool arguments compile; a schema the
grammar cannot enforce is refused when the grammar is built, naming the tool and the keyword.

Admitted answers are sampled by random walks through the grammar's token masks (the demo tokenizer's
vocabulary, markers by id), biased towards tokens that close strings and containers so walks end.
"""

from __future__ import annotations

import copy
import enum
import json
import random
from typing import Literal, Optional, Union

import jsonschema
import numpy as np
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needle_hf.generation.grammar import (NUMBER_BOUND, ToolCallGrammar, ToolGrammarError, allowed_tokens, token_bytes,
                               tool_calls_json_schema)
from needle_hf.tools.tool_calls import MAX_JSON_DEPTH, parse_assistant_turn

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)


# --- pydantic models: every feature pydantic writes for tool arguments -----------------------------

class Unit(enum.Enum):
    CELSIUS = "c"
    FAHRENHEIT = "f"


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(description="City name", min_length=1, max_length=12)
    country: Optional[str] = None


class Reading(pydantic.BaseModel):
    place: Place
    unit: Unit = Unit.CELSIUS
    days: int = pydantic.Field(default=1, ge=1, le=14)
    hours: list[int] = pydantic.Field(default_factory=list, max_length=3)
    mode: Literal["now", "forecast"] = "now"


class Tree(pydantic.BaseModel):
    label: str = pydantic.Field(pattern=r"^[a-z]{1,4}$")
    children: list["Tree"] = []


class Alarm(pydantic.BaseModel):
    time: str = pydantic.Field(pattern=r"^[0-2][0-9]:[0-5][0-9]$")
    label: Optional[str] = pydantic.Field(default=None, max_length=8)
    volume: float = pydantic.Field(default=0.5, ge=0, le=1, multiple_of=0.25)
    tags: dict[str, int] = {}
    target: Union[Place, int, None] = None
    pair: tuple[int, str] = (0, "a")
    extra: dict = {}


class Cat(pydantic.BaseModel):
    kind: Literal["cat"] = "cat"
    lives: int = pydantic.Field(ge=0, le=9)


class Dog(pydantic.BaseModel):
    kind: Literal["dog"] = "dog"
    good: bool = True


class Pet(pydantic.BaseModel):
    pet: Union[Cat, Dog] = pydantic.Field(discriminator="kind")


MODELS = {"get_weather": Reading, "draw_tree": Tree, "set_alarm": Alarm, "adopt": Pet, "place": Place}


def pydantic_tools():
    return [{"type": "function", "function": {"name": name, "description": model.__doc__ or name,
                                              "parameters": model.model_json_schema()}}
            for name, model in MODELS.items()]


# --- random walks through the grammar ------------------------------------------------------------

_CLOSERS = (b'"', b"]", b"}", b",", b":")


@pytest.fixture(scope="module")
def grammar(demo_tokenizer):
    return ToolCallGrammar(demo_tokenizer)


@pytest.fixture(scope="module")
def pieces(demo_tokenizer):
    """Per id: its text (markers spelled out), and whether it closes something (a bias for walks)."""
    tokens, special = token_bytes(demo_tokenizer)
    special = set(special)
    texts = [token[1:].decode() if index in special else token for index, token in enumerate(tokens)]
    closing = np.array([index in special or any(c in token for c in _CLOSERS) for index, token in enumerate(tokens)])
    return texts, closing


def walk(grammar, pieces, tools, rng, *, steps=400):
    """An answer the grammar admits, token by token (None when the walk did not end in ``steps``)."""
    texts, closing = pieces
    matcher = grammar.matcher(tools)
    written = []
    for _ in range(steps):
        if matcher.is_stopped():
            break
        mask = allowed_tokens(matcher, grammar.vocab_size)
        assert mask.any(), "the grammar must never leave a dead end"
        ids = np.flatnonzero(mask & closing) if rng.random() < 0.6 and (mask & closing).any() else np.flatnonzero(mask)
        token = int(rng.choice(ids))
        assert matcher.consume_token(token), matcher.get_error()
        written.append(token)
    if not matcher.is_stopped() and not matcher.is_accepting():
        return None
    data = b"".join(texts[t] if isinstance(texts[t], bytes) else texts[t].encode() for t in written)
    return data.decode("utf-8")


def assert_answer_is_valid(text, tools):
    """The answer parses, its calls satisfy the payload schema the grammar was built from, and each
    call satisfies its tool's own schema (a ``oneOf`` aside: the grammar closes nested objects to
    undeclared keys, which can make branches exclusive that the loose schema lets overlap)."""
    schemas = {tool["function"]["name"] if "function" in tool else tool["name"]:
               (tool["function"] if "function" in tool else tool).get("parameters") or {"type": "object"}
               for tool in tools}
    turn = parse_assistant_turn(text)
    jsonschema.validate(turn.tool_calls, tool_calls_json_schema(tools))
    for call in turn.tool_calls:
        assert call["name"] in schemas, text
        if "oneOf" not in json.dumps(schemas[call["name"]]):
            jsonschema.validate(call["arguments"], schemas[call["name"]])
    return turn


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), chosen=st.sets(st.sampled_from(sorted(MODELS)), min_size=1))
def test_answers_the_grammar_admits_for_pydantic_tools_parse_and_validate(grammar, pieces, seed, chosen):
    tools = [tool for tool in pydantic_tools() if tool["function"]["name"] in chosen]
    text = walk(grammar, pieces, tools, random.Random(seed))
    if text is not None:
        assert_answer_is_valid(text, tools)


# --- generated schemas, with values they hold ------------------------------------------------------

_PLAIN = st.text(st.characters(exclude_characters="\x7f", exclude_categories=("Cs",)), max_size=8)


def _number_text_is_plain(value):
    return "e" not in json.dumps(value) and abs(value) <= NUMBER_BOUND


leaf_schemas = st.one_of(
    st.just(({"type": "integer"}, st.integers(-10**15, 10**15))),
    st.just(({"type": "number"}, st.floats(-1e6, 1e6).filter(_number_text_is_plain))),
    st.just(({"type": "boolean"}, st.booleans())),
    st.just(({"type": "null"}, st.none())),
    st.just(({"type": "string"}, _PLAIN)),
    st.just(({"type": "string", "maxLength": 3}, _PLAIN.filter(lambda s: len(s) <= 3))),
    st.just(({"type": "integer", "minimum": 0, "maximum": 9}, st.integers(0, 9))),
    st.lists(st.sampled_from(["a", "b", "Zoë", "x y"]), min_size=1, max_size=3, unique=True).map(
        lambda options: ({"enum": options}, st.sampled_from(options))),
    st.just(({}, st.none())),  # any value
    st.just(({"description": "anything"}, st.integers(-5, 5))),
)


def _extend(children):
    def obj(fields):
        schema = {"type": "object", "properties": {key: sub for key, (sub, _) in fields.items()},
                  "required": list(fields)}
        # llguidance writes properties in the schema's order (its documented departure from JSON Schema)
        return schema, st.fixed_dictionaries({key: values for key, (_, values) in fields.items()}).map(
            lambda value: {key: value[key] for key in fields})

    return st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "c", "é"]), children, max_size=3).map(obj),
        children.map(lambda pair: ({"type": "array", "items": pair[0], "maxItems": 3}, st.lists(pair[1], max_size=3))),
        children.map(lambda pair: ({"anyOf": [pair[0], {"type": "null"}]}, st.one_of(st.none(), pair[1]))),
        children.map(lambda pair: ({"type": "object", "additionalProperties": pair[0]},
                                   st.dictionaries(_PLAIN, pair[1], max_size=2))),
    )


value_schemas = st.recursive(leaf_schemas, _extend, max_leaves=6)


@st.composite
def tools_with_arguments(draw):
    """(tool, arguments): a tool whose parameters use $defs/$ref, and arguments its schema holds."""
    (inner, inner_values), (field, field_values) = draw(value_schemas), draw(value_schemas)
    parameters = {"type": "object", "$defs": {"Inner": inner},
                  "properties": {"x": {"$ref": "#/$defs/Inner"}, "y": field}, "required": ["x", "y"]}
    arguments = {"x": draw(inner_values), "y": draw(field_values)}
    return {"name": "tool", "parameters": parameters}, arguments


@settings(max_examples=80, deadline=None)
@given(case=tools_with_arguments(), seed=st.integers(0, 2**32 - 1))
def test_generated_schemas_admit_their_values_and_only_answers_the_parser_accepts(grammar, pieces, case, seed):
    tool, arguments = case
    jsonschema.validate(arguments, tool["parameters"])
    # parser-accepted, schema-valid arguments written as the fine-tuning data writes them: the grammar admits them
    payload = json.dumps([{"name": "tool", "arguments": arguments}], ensure_ascii=False, separators=(",", ":"))
    matcher = grammar.matcher([tool])
    assert admits(grammar, [tool], payload), payload
    # and what the grammar admits, the parser accepts
    text = walk(grammar, pieces, [tool], random.Random(seed))
    if text is not None:
        assert_answer_is_valid(text, [tool])


def admits(grammar, tools, payload):
    """Whether the grammar admits ``<tool_call>{payload}</tool_call><|im_end|>`` (payload tokenized as text)."""
    matcher = grammar.matcher(tools)
    ids = [grammar.marker_ids["<tool_call>"], *grammar.llg_tokenizer.tokenize_str(payload),
           grammar.marker_ids["</tool_call>"], grammar.marker_ids["<|im_end|>"]]
    return all(matcher.consume_token(token) for token in ids) and (matcher.is_accepting() or matcher.is_stopped())


def test_recursive_schemas_never_nest_deeper_than_the_parser_reads(grammar, pieces):
    tools = [{"name": "tree", "parameters": {"type": "object", "properties": {"n": {"$ref": "#"}}}},
             {"name": "blob", "parameters": {"type": "object", "properties": {"v": {}}}}]
    rng = random.Random(0)
    for _ in range(25):
        text = walk(grammar, pieces, tools, rng, steps=600)
        if text is not None:
            assert_answer_is_valid(text, tools)
    # The arguments object sits at depth 2 of the calls list, so 62 levels more fit and no more.
    for name, key, opening in (("tree", "n", '{"n":'), ("blob", "v", '{"v":')):
        for levels, admitted in ((MAX_JSON_DEPTH - 2, True), (MAX_JSON_DEPTH - 1, False)):
            inner = opening * levels + ("{}" if name == "tree" else "1") + "}" * levels
            payload = f'[{{"name":"{name}","arguments":{inner}}}]'
            assert admits(grammar, tools, payload) == admitted, (name, levels)
            if admitted:
                parse_assistant_turn(f"<tool_call>{payload}</tool_call>")


# --- pydantic features compile; unsupported schemas are refused --------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_pydantic_model_compiles_as_a_tool(grammar, name):
    tool = {"name": name, "parameters": MODELS[name].model_json_schema()}
    grammar.matcher([tool])


@pytest.mark.parametrize("parameters, keyword", [
    ({"type": "string"}, "'type'"),
    ({"type": "array", "items": {}}, "'type'"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "'uniqueItems'"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "'not'"),
    ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "'if'"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "'\\$ref'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "points to nothing"),
    ({"type": "object", "properties": {"a": {"type": "number", "maximum": 1e300}}}, "'maximum'"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}, "oneOf"),
    ({"type": "object", "properties": {"a": 3}}, "expected a schema"),
    ("nope", "must be a JSON schema object"),
])
def test_unsupported_schemas_are_refused_naming_tool_and_keyword(grammar, parameters, keyword):
    tools = [{"name": "fine", "parameters": {"type": "object"}}, {"name": "broken", "parameters": parameters}]
    with pytest.raises(ToolGrammarError, match=f"tool broken: .*{keyword}"):
        grammar.matcher(tools)


_UNSUPPORTED = ["not", "if", "uniqueItems", "contains", "propertyNames", "dependentRequired", "unevaluatedProperties"]


@settings(max_examples=40, deadline=None)
@given(case=tools_with_arguments(), keyword=st.sampled_from(_UNSUPPORTED), data=st.data())
def test_an_unsupported_keyword_anywhere_is_refused_by_name(grammar, case, keyword, data):
    tool = copy.deepcopy(case[0])  # the strategies hand out shared schema objects
    nodes = []

    def collect(node):
        if isinstance(node, dict):
            nodes.append(node)
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(tool["parameters"])
    nodes = [node for node in nodes if "type" in node or "$ref" in node or "anyOf" in node]
    data.draw(st.sampled_from(nodes))[keyword] = {}
    with pytest.raises(ToolGrammarError, match=f"tool tool: .*'{keyword}'"):
        grammar.matcher([tool])


@pytest.mark.parametrize("parameters", [None, {}, {"type": "object"}])
def test_no_parameters_means_empty_arguments(grammar, pieces, parameters):
    tool = {"name": "ping"} | ({} if parameters is None else {"parameters": parameters})
    for seed in range(5):
        text = walk(grammar, pieces, [tool], random.Random(seed))
        assert text is not None
        assert all(call["arguments"] == {} for call in parse_assistant_turn(text).tool_calls)
