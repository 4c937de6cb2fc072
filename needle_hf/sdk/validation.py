"""Grounding checks on tool-call arguments: is each value something the user actually said?

Every path below is a `Tool.path` string: the tool name, a dot, then the argument path inside
``arguments`` written ``key.sub[2].leaf`` (`argument_paths`).

The reference SDK's public rules, reproduced exactly:
  - Years (`source_years`): a text licenses the years it writes as a date: ``12 March 2026``,
    ``March 12th, 2026``, ``March 2026``, ``year 2026``, ``2026-03-12`` or ``2026/3/12`` (month
    names in English, full or abbreviated, any case). A string argument whose schema says
    ``format: date`` or ``date-time`` and that starts ``YYYY-`` is ungrounded when the texts seen
    since the last reset license some years and ``YYYY`` is not one of them (no licensed year: no
    check). The system text licenses years only once the conversation has licensed one.
  - Schemas are walked through ``$ref`` (JSON pointers into the parameters, cycles stopped) and an
    ``anyOf``/``oneOf`` with exactly one non-null member (``Optional[X]``).
  - Numbers (`grounded_number_paths`): a numeric argument is grounded when its value is a number
    written in the query or system text. Numbers are read as digits (of any script) with an optional
    sign, decimals and comma thousands separators (``1,200.50``); a digit run glued to a letter, dot or
    comma on its left is not a number. ``run(strict=True)`` lets a flagged number through when it
    is grounded this way.

Our rules for what the reference's engine checks in closed code (`ground_arguments`,
`is_negated`), applied to every answer:
  - A string argument is grounded when every word of it occurs among the words of the texts seen
    since the last reset (system, queries, tool results). Words are runs of letters and runs of digits
    (``7am`` is ``7`` and ``am``) after NFKC normalisation, with accents dropped and case folded
    (``Zurich`` is ``Zürich``); digit runs in any script compare by value
    (``٣`` is ``3``, ``07`` is ``7``), so do numbers written with thousands separators, and a run of
    zeros is always grounded (the ``00`` of ``7:00`` for ``7am``). Values fixed by the schema
    (``enum``, ``const``), dates (checked by the year rule) and texts with no word are exempt.
  - A number (not a bool) is grounded when its value occurs among the numbers of those texts
    (ASCII or any other script's digits; ``,``, ``_``, thin and no-break spaces between groups of
    three digits removed) or among the values English number words spell (``twenty five`` is 25) in
    the user's texts (queries, tool results), or when the schema fixes it (``enum``, ``const``). The
    system text's number words do not count: an instruction's "one" is a determiner ("make one call
    per action"), and read as 1 it would ground any 1 the model writes.
  - Negation: the latest user text is negated when a clause opens with a negation cue:
    ``don't``/``do not``/``dont``/``never``/``no need to``/``not``, at the start of the text, after
    clause punctuation or after ``please``/``and``/``but``/``then``/``so``/``just``. Apostrophe
    variants count. ``I can't sleep, turn on the fan`` is not negated (the cue follows a subject).
"""

from __future__ import annotations

import decimal
import re
import unicodedata
from typing import Any, Iterable, Iterator

_MONTH = (r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|jun(?:e)?|jul(?:y)?|aug(?:ust)?|"
          r"sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)")
_END = r"(?![0-9A-Za-z])"
_YEAR_PATTERNS = tuple(re.compile(pattern) for pattern in (
    rf"\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}[\s,]+(\d{{1,4}}){_END}",           # 12 march 2026
    rf"\b{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?\s*,?\s+(\d{{1,4}}){_END}",        # march 12th, 2026
    rf"\b{_MONTH}[\s,]+(\d{{3,4}}){_END}",                                     # march 2026
    rf"\byear\s+(\d{{1,4}}){_END}",                                            # year 2026
    r"(?<![0-9])(\d{1,4})(?=[-/]\d{1,2}[-/]\d{1,2}(?![0-9]))",                 # 2026-03-12, 2026/3/12
))
_DATE_YEAR = re.compile(r"^(\d{4})-")
_DATE_FORMATS = ("date", "date-time")
# A number: sign, digits (any script), comma groups or none, decimals; not glued to a word, dot or comma on its left.
_SOURCE_NUMBER = re.compile(r"(?<![\w.,])(?:[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\d+(?:\.\d+)?)(?!\d)")
_NEGATION = re.compile(
    r"(?:^|[.,;:!?\n]\s*|\b(?:please|and|but|then|so|just)\s+)(?:don't|do not|dont|never|no need to|not)\b")
_APOSTROPHES = dict.fromkeys(map(ord, "\u2019\u2018\u02bc\uff07`\u00b4"), "'")
_WORD = re.compile(r"\d+|[^\W\d]+")  # digit runs and letter runs apart: "7am" is "7" and "am"
# Digit groups (any script) joined by a group separator, with optional decimals.
_ANY_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[,_\u2009\u202f\u00a0]\d{3})*(?:[.]\d+)?(?![\d])")
_UNITS = {word: value for value, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {word: 10 * (index + 2)
         for index, word in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 1_000_000}


# ------------------------------------------------------------------------------------------------
# The reference's public rules


def source_years(text: str) -> set[int]:
    """The years ``text`` writes as part of a date (see the module docstring)."""
    lowered = (text or "").lower()
    return {int(match.group(1)) for pattern in _YEAR_PATTERNS for match in pattern.finditer(lowered)}


def licensed_years(seen_years: set[int], system: str | None = None) -> set[int]:
    """The years a date argument may use: those seen, plus the system text's once any is seen."""
    return set(seen_years) | (source_years(system) if seen_years and system else set())


def schema_parameters(schema: dict) -> dict:
    """The parameters object of a tool schema (a bare parameters schema is returned as it is)."""
    return schema.get("parameters", schema) if isinstance(schema, dict) else {}


def resolve_ref(node: Any, root: dict) -> Any:
    """Follow ``$ref`` JSON pointers (``#/$defs/X``) from ``node`` within ``root``; a cycle stops where it closes."""
    seen = set()
    while isinstance(node, dict) and "$ref" in node and node["$ref"] not in seen:
        seen.add(node["$ref"])
        target = root
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(target, dict) else {}
        if target is node:
            break
        node = target
    return node


def _concrete(node: Any, root: dict) -> Any:
    """The node itself, or the single non-null member of its anyOf/oneOf (Optional[X] -> X)."""
    node = resolve_ref(node, root)
    if not isinstance(node, dict):
        return {}
    variants = node.get("anyOf") or node.get("oneOf") or []
    concrete = [variant for variant in variants if resolve_ref(variant, root).get("type") != "null"]
    return resolve_ref(concrete[0], root) if len(concrete) == 1 else node


def walk_arguments(schema: dict, arguments: Any) -> Iterator[tuple[str, Any, dict]]:
    """Yield ``(path, value, schema node)`` for every leaf of ``arguments`` the schema declares.

    Keys the schema does not declare and list items without an ``items`` schema are not visited;
    a string with a date format is a leaf.
    """
    root = schema_parameters(schema)

    def walk(value, node, path):
        node = _concrete(node, root)
        if node.get("format") in _DATE_FORMATS and isinstance(value, str):
            yield path, value, node
        elif isinstance(value, dict):
            properties = node.get("properties", {})
            for key, item in value.items():
                if key in properties:
                    yield from walk(item, properties[key], f"{path}.{key}" if path else key)
        elif isinstance(value, list) and "items" in node:
            for index, item in enumerate(value):
                yield from walk(item, node["items"], f"{path}[{index}]")
        else:
            yield path, value, node

    yield from walk(arguments, root, "")


def date_year_check(schema: dict, arguments: Any, years: set[int]) -> tuple[set[str], set[str]]:
    """(checked paths, failed paths) of the year rule for one call's arguments."""
    checked, failed = set(), set()
    for path, value, node in walk_arguments(schema, arguments):
        if node.get("format") in _DATE_FORMATS and isinstance(value, str):
            match = _DATE_YEAR.match(value)
            if match and years:
                checked.add(path)
                if int(match.group(1)) not in years:
                    failed.add(path)
    return checked, failed


def _numeric_leaves(arguments: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(arguments, bool):
        return
    if isinstance(arguments, (int, float)):
        yield path, arguments
    elif isinstance(arguments, dict):
        for key, item in arguments.items():
            yield from _numeric_leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(arguments, list):
        for index, item in enumerate(arguments):
            yield from _numeric_leaves(item, f"{path}[{index}]")


def source_numbers(*texts: str | None) -> set[decimal.Decimal]:
    """The numbers written in ``texts`` under the reference's reading (comma groups, no other separator)."""
    joined = "\n".join(text for text in texts if text)
    return {decimal.Decimal(match.group(0).replace(",", "")) for match in _SOURCE_NUMBER.finditer(joined)}


def _as_decimal(value: Any) -> decimal.Decimal | None:
    try:
        return decimal.Decimal(str(value))
    except (decimal.InvalidOperation, ValueError):
        return None


def grounded_number_paths(arguments: Any, *texts: str | None) -> set[str]:
    """Argument paths (no tool prefix) of the numbers in ``arguments`` that ``texts`` write."""
    numbers = source_numbers(*texts)
    return {path for path, value in _numeric_leaves(arguments) if numbers and _as_decimal(value) in numbers}


# ------------------------------------------------------------------------------------------------
# Our rules for the engine's closed checks


def _normalised(text: str) -> str:
    """NFKC, accents dropped, apostrophes unified, case folded."""
    decomposed = unicodedata.normalize("NFKD", text or "")
    bare = "".join(char for char in decomposed if not unicodedata.combining(char))
    return unicodedata.normalize("NFKC", bare).translate(_APOSTROPHES).casefold()


def _number_words(words: list[str]) -> set[int]:
    """Values spelled by runs of English number words (``twenty five``, ``three hundred``)."""
    values, total, current, in_run = set(), 0, 0, False
    for word in [*words, ""]:
        if word in _UNITS or word in _TENS:
            current += _UNITS.get(word, 0) + _TENS.get(word, 0)
            in_run = True
        elif word in _SCALES and in_run:
            current = max(current, 1) * _SCALES[word]
            if _SCALES[word] >= 1000:
                total, current = total + current, 0
        else:
            if in_run:
                values.add(total + current)
            total, current, in_run = 0, 0, False
    return values


def _numbers_in(text: str) -> set[decimal.Decimal]:
    numbers = set()
    for match in _ANY_NUMBER.finditer(text):
        digits = re.sub(r"[,_\u2009\u202f\u00a0]", "", match.group(0))
        sign, digits = (digits[0], digits[1:]) if digits[0] in "+-" else ("", digits)
        whole, _, fraction = digits.partition(".")
        try:
            decimals = "".join(str(int(digit)) for digit in fraction)  # digits of any script as ASCII
            value = decimal.Decimal(f"{sign}{int(whole)}" + (f".{decimals}" if decimals else ""))
        except ValueError:
            continue
        numbers.add(value)
        numbers.add(abs(value))  # "-5" and "5 below zero" read alike; the sign is the model's call
    return numbers


class GroundingSources:
    """The words and numbers of the texts a conversation has seen (system, queries, tool results)."""

    def __init__(self, texts: Iterable[str] = (), *, instructions: str | None = None):
        """``texts``: the user's texts (queries, tool results); ``instructions``: the system text, whose
        number words are not read as numbers."""
        self.words: set[str] = set()
        self.numbers: set[decimal.Decimal] = set()
        self.add(instructions, number_words=False)
        for text in texts:
            self.add(text)

    def add(self, text: str | None, *, number_words: bool = True) -> None:
        """Take in ``text``'s words and numbers (with ``number_words``, also the values its number words spell)."""
        normalised = _normalised(text or "")
        words = _WORD.findall(normalised)
        self.words.update(words)
        self.numbers |= _numbers_in(text or "")  # before NFKC, which turns no-break and thin spaces into spaces
        if number_words:
            self.numbers |= {decimal.Decimal(value) for value in _number_words(words)}
        self.words.update(str(int(number)) for number in self.numbers if number == number.to_integral())

    def copy(self) -> "GroundingSources":
        copied = GroundingSources()
        copied.words, copied.numbers = set(self.words), set(self.numbers)
        return copied

    def has_string(self, value: str) -> bool:
        for word in _WORD.findall(_normalised(value)):
            if word in self.words:
                continue
            if word.isdigit() and (int(word) == 0 or int(word) in self.numbers):
                continue  # a number the texts write, or zero padding ("7:00" for "7am")
            return False
        return True

    def has_number(self, value: Any) -> bool:
        number = _as_decimal(value)
        return number is not None and (number in self.numbers or abs(number) in self.numbers)


def _fixed_by_schema(node: dict) -> bool:
    return "enum" in node or "const" in node


def ground_arguments(schema: dict, arguments: Any, sources: GroundingSources) -> list[str]:
    """Argument paths (no tool prefix) whose strings or numbers the sources do not hold, in walk order."""
    ungrounded = []
    for path, value, node in walk_arguments(schema, arguments):
        if _fixed_by_schema(node) or node.get("format") in _DATE_FORMATS or isinstance(value, bool):
            continue
        if isinstance(value, str) and not sources.has_string(value):
            ungrounded.append(path)
        elif isinstance(value, (int, float)) and not sources.has_number(value):
            ungrounded.append(path)
    return ungrounded


def is_negated(text: str) -> bool:
    """Does a clause of ``text`` open with a negation cue (see the module docstring)?"""
    return _NEGATION.search(_normalised(text).strip()) is not None


def paths_by_tool(ungrounded: Iterable[str]) -> dict[str, set[str]]:
    """``["Tool.a.b", ...]`` -> ``{"Tool": {"a.b"}}`` (a bare tool name maps to itself)."""
    grouped: dict[str, set[str]] = {}
    for name in ungrounded:
        tool, _, path = str(name).partition(".")
        grouped.setdefault(tool, set()).add(path or tool)
    return grouped


__all__ = ["GroundingSources", "date_year_check", "ground_arguments", "grounded_number_paths", "is_negated",
           "licensed_years", "paths_by_tool", "resolve_ref", "schema_parameters", "source_numbers", "source_years",
           "walk_arguments"]
