"""Grounding checks (`needle_hf.sdk.validation`): the reference's public rules give the reference's
answers on hostile texts (generated and hand-written), and our rules for the closed checks behave as
documented. The two twins' agreement on whole envelopes is in test_sdk_needle.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("NEEDLE_TELEMETRY", "0")  # the reference SDK's opt-out, before it is imported
os.environ.setdefault("DO_NOT_TRACK", "1")

import needle  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import needle_hf  # noqa: E402
from needle_hf.sdk import validation  # noqa: E402
from needle_hf.sdk.needle import ExtractionValidationError, _validate_extraction  # noqa: E402

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

# Pieces that hostile texts are assembled from: dates in many spellings, numbers with separators,
# digits of other scripts, glued units and punctuation.
DATE_PIECES = ["12 March 2026", "march 12th, 2026", "Mar 2026", "sept 1999", "year 2031", "2026-03-12", "2026/3/1",
               "12/03/2026", "'26", "2026年3月", "MARCH 3RD 2026", "3rd of March 2026", "dec,2024", "may 5, 20",
               "10-11-12", "99-1-1", "12345-1-1", "Jan 2026x", "the year 1", "2026-13-45"]
NUMBER_PIECES = ["1,200", "1,200.50", "-3", "+4.5", "3.14.15", "1,20", "12,345,678", "007", "1e3", "١٢٣", "٣", "x42",
                 "42x", "4.", ".5", "1_000", "1 000", "1\u202f000", "$1,200.00", "3,400,", "50%", "v2.0", "10k"]
GLUE = [" ", "", ", ", ".", "-", "/", " on ", " and ", "\n", "!"]


def hostile_text():
    return st.lists(st.sampled_from(DATE_PIECES + NUMBER_PIECES + ["turn on", "Zürich", "do not", "x"]) | st.text(max_size=6),
                    max_size=8).flatmap(lambda parts: st.lists(st.sampled_from(GLUE), min_size=len(parts), max_size=len(parts))
                                        .map(lambda glue: "".join(p + g for p, g in zip(parts, glue))))


# ------------------------------------------------------------------------------------------------
# The reference's public rules, exactly


@settings(max_examples=400, deadline=None)
@given(hostile_text())
def test_years_are_the_reference_years(text):
    assert validation.source_years(text) == needle._source_years(text)


@settings(max_examples=400, deadline=None)
@given(hostile_text())
def test_numbers_are_the_reference_numbers(text):
    assert validation.source_numbers(text) == needle._source_numbers(text)


ARGUMENTS = st.recursive(
    st.one_of(st.integers(-2000, 2000), st.floats(-1e4, 1e4, allow_nan=False), st.booleans(), st.text(max_size=4),
              st.sampled_from([1200, 1200.5, 3, 2026, -3, 4.5])),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "c.d"]), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(ARGUMENTS, hostile_text(), st.one_of(st.none(), hostile_text()))
def test_numeric_grounding_is_the_reference_grounding(arguments, query, system):
    assert validation.grounded_number_paths(arguments, query, system) == needle._grounded_number_paths(arguments, query, system)


TRIP_SCHEMA = {"name": "Trip", "parameters": {
    "type": "object",
    "properties": {"start": {"type": "string", "format": "date"},
                   "stays": {"type": "array", "items": {"$ref": "#/$defs/Stay"}},
                   "backup": {"anyOf": [{"$ref": "#/$defs/Stay"}, {"type": "null"}]},
                   "loop": {"$ref": "#/$defs/Loop"}},
    "$defs": {"Stay": {"type": "object", "properties": {"check_in": {"type": "string", "format": "date-time"},
                                                        "nights": {"type": "integer"}}},
              "Loop": {"$ref": "#/$defs/Loop"}}}}
DATES = st.sampled_from(["2026-03-12", "2025-01-01T10:00", "1999-12-31", "26-01-01", "2026", "not a date", "2031-2-2"])
TRIP_ARGUMENTS = st.fixed_dictionaries({"start": DATES}, optional={
    "stays": st.lists(st.fixed_dictionaries({"check_in": DATES}, optional={"nights": st.integers(0, 9)}), max_size=3),
    "backup": st.one_of(st.none(), st.fixed_dictionaries({"check_in": DATES})),
    "loop": st.sampled_from(["2026-01-01", {"x": 1}]), "extra": DATES})


@settings(max_examples=300, deadline=None)
@given(TRIP_ARGUMENTS, st.sets(st.sampled_from([1999, 2025, 2026, 2031]), max_size=3))
def test_year_check_walks_refs_and_optional_as_the_reference(arguments, years):
    assert validation.date_year_check(TRIP_SCHEMA, arguments, years) == needle._walk_grounding(TRIP_SCHEMA, arguments, years)


@pytest.mark.parametrize("seen, system, expected", [
    (set(), "Today is 12 March 2026.", set()),            # the system text licenses years only once a query has
    ({2025}, "Today is 12 March 2026.", {2025, 2026}),
    ({2025}, None, {2025}),
])
def test_system_years_count_only_after_a_query_year(seen, system, expected):
    assert validation.licensed_years(seen, system) == needle._licensed_years(seen, system) == expected


@pytest.mark.parametrize("text, arguments, flagged, negated, problem", [
    ("Book it for 12 March 2026", {"start": "2025-03-12"}, [], False, "start"),           # the year contradicts the text
    ("Book it for 12 March 2026", {"start": "2026-03-12"}, ["Trip.start"], False, None),  # a passing year check clears a flag
    ("Book 3 nights from 2026-01-01", {"start": "2026-01-01", "stays": [{"check_in": "2026-01-01T00:00", "nights": 3}]},
     ["Trip.stays[0].nights"], False, None),                                          # a number the text writes
    ("Book nights from 2026-01-01", {"start": "2026-01-01", "stays": [{"check_in": "2026-01-01T00:00", "nights": 3}]},
     ["Trip.stays[0].nights"], False, r"stays\[0\].nights"),
    ("Book 1,200 nights", {"start": "x", "stays": [{"check_in": "y", "nights": 1200}]}, ["Trip.stays[0].nights"], False, None),
    ("don't book anything", {"start": "2026-01-01"}, [], True, "negated request"),
])
def test_strict_extraction_rule_is_the_reference_rule(text, arguments, flagged, negated, problem):
    envelope = {"validation": {"ungrounded": flagged, "negation": negated}}
    reference_error = None
    try:
        needle._validate_extraction(text, TRIP_SCHEMA, arguments, envelope, None)
    except needle.ExtractionValidationError as error:
        reference_error = error
    if problem is None:
        assert reference_error is None
        _validate_extraction(text, TRIP_SCHEMA, arguments, envelope, None)
    else:
        assert reference_error is not None
        with pytest.raises(ExtractionValidationError, match=problem):
            _validate_extraction(text, TRIP_SCHEMA, arguments, envelope, None)
    assert issubclass(needle_hf.ExtractionValidationError, ValueError)


# ------------------------------------------------------------------------------------------------
# Our rules for the closed checks

SCHEMA = {"name": "book", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "guests": {"type": "integer"}, "price": {"type": "number"},
    "room": {"type": "string", "enum": ["single", "double"]}, "day": {"type": "string", "format": "date"},
    "kind": {"const": "hotel"}, "pets": {"type": "boolean"}, "notes": {"type": "array", "items": {"type": "string"}}}}}


@pytest.mark.parametrize("text, arguments, ungrounded", [
    ("Book Zürich for two guests", {"city": "ZURICH", "guests": 2}, []),                         # accents and case; number words
    ("Book Zurich for twenty five guests", {"city": "zürich", "guests": 25}, []),
    ("Book Paris", {"city": "Lyon"}, ["city"]),                                                   # a made-up string
    ("Book Paris", {"city": "Paris, France"}, ["city"]),                                          # one made-up word is enough
    ("Book for ٣ guests at ١٬٢٠٠", {"guests": 3}, []),                                           # Arabic-Indic digits
    ("Book for 3 guests", {"guests": 4}, ["guests"]),
    ("Budget 1,200.50 dollars", {"price": 1200.5}, []),                                          # separators and decimals
    ("Budget 1\u202f200 dollars", {"price": 1200}, []),                                           # a thin space between groups
    ("Budget 1 200 dollars", {"price": 1200}, ["price"]),                                         # a plain space separates numbers
    ("Budget １２ dollars", {"price": 12}, []),                                                    # full-width digits
    ("Budget 12 dollars", {"price": 12.5}, ["price"]),
    ("Wake me at 7am", {"city": "7:00"}, []),                                                     # zero padding of a time
    ("Wake me at 7am", {"city": "7:05"}, ["city"]),
    ("anything", {"room": "double", "kind": "hotel", "pets": True, "day": "1999-01-01"}, []),     # fixed by the schema, or dates
    ("note milk and eggs", {"notes": ["milk", "bread"]}, ["notes[1]"]),
    ("", {"city": "", "notes": ["!!"]}, []),                                                      # no word: nothing made up
])
def test_strings_and_numbers_are_grounded_in_the_texts_seen(text, arguments, ungrounded):
    assert validation.ground_arguments(SCHEMA, arguments, validation.GroundingSources([text])) == ungrounded


@pytest.mark.parametrize("system, text, arguments, ungrounded", [
    ("Make one call per requested action.", "dim the lights to 150 percent", {"guests": 1}, ["guests"]),
    ("Make one call per requested action.", "Book for one guest", {"guests": 1}, []),      # the user's "one" counts
    ("Rooms hold at most 4 guests.", "Book a room", {"guests": 4}, []),                    # the system's digits count
    ("No one may book twenty rooms.", "Book the rooms", {"guests": 20, "city": "one"}, ["guests"]),  # its words stay words
])
def test_the_system_texts_number_words_are_not_numbers(system, text, arguments, ungrounded):
    sources = validation.GroundingSources([text], instructions=system)
    assert validation.ground_arguments(SCHEMA, arguments, sources) == ungrounded


@pytest.mark.parametrize("text, negated", [
    ("don't turn on the study lights", True),
    ("Do not close the living room blinds", True),
    ("never run the vacuum while I am on a call", True),
    ("turn off the lights and don\u2019t open the blinds", True),          # a curly apostrophe
    ("lights on. NOT the fan", True),
    ("please dont call mom", True),
    ("no need to set an alarm", True),
    ("I can't sleep, turn on the fan", False),                             # the cue follows a subject
    ("is it not raining?", False),
    ("turn on the notification sound", False),                             # "not" inside a word
    ("donate 5 dollars", False),
    ("play Never Gonna Give You Up", False),
])
def test_negation_is_a_clause_opening_with_a_cue(text, negated):
    assert validation.is_negated(text) is negated
