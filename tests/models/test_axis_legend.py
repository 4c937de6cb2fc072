"""Every shape annotation in the Needle 2 twins' comments and docstrings uses the one axis legend.

`specification_needle.py` holds the legend (one upper-case letter per axis, explained once). A shape
annotation is a bracketed, comma-separated list such as ``[B, T, D]`` or ``[B, 1, T, S]`` whose items
are axis letters, numbers, ``...``, named extents (``tables``) or arithmetic of them (``N * H``).
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "needle_hf" / "models" / "needle"
TWIN_FILES = [
    "modeling_needle.py", "ops_needle.py", "masking_needle.py", "heads_needle.py", "generation_needle.py",
    "cache_needle.py", "loading_needle.py", "norms_needle.py", "compiled_decoding_needle.py",
    "modeling_flax_needle.py", "ops_flax_needle.py", "masking_flax_needle.py", "heads_flax_needle.py",
    "cache_flax_needle.py", "loading_flax_needle.py", "norms_flax_needle.py", "specification_needle.py",
    # One module per concept, the same names in both twins.
    "step_inputs_needle.py", "projections_needle.py", "projections_flax_needle.py", "hadamard_mlp_needle.py",
    "hadamard_mlp_flax_needle.py", "hyper_connections_needle.py", "hyper_connections_flax_needle.py",
    "engram_needle.py", "engram_flax_needle.py", "mtp_needle.py", "mtp_flax_needle.py", "generation_flax_needle.py",
    "rematerialisation_flax_needle.py",
]
# Private abbreviations that stood for legend axes (D, H, K) before there was one legend.
STAND_INS = {"d", "hd", "KV", "head_dim", "d_model"}

_ROW_LETTERS = re.compile(r"(?:^|\s{2,})([A-Z](?:, [A-Z])*)\s{2,}\S")
_BRACKET = re.compile(r"\[([^\[\]]+)\]")
_TERM = r"(?:\.\.\.|[A-Za-z_][A-Za-z0-9_]*|\d+)"
_ITEM = re.compile(rf"^\(?{_TERM}(?:\s*[-+*/]{{1,2}}\s*\(?{_TERM}\)?)*\)?$")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def legend_letters() -> set[str]:
    """The axis letters of the legend table in the specification's module docstring."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "specification_needle.py").read_text()))
    table = doc.split("Axis legend", 1)[1].split("\n\n", 2)[1]
    letters = set()
    for line in table.splitlines():
        if line.strip().startswith("="):
            continue
        for match in _ROW_LETTERS.finditer(line):
            letters.update(match.group(1).split(", "))
    return letters


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in a module."""
    texts = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                texts.append((body[0].lineno, body[0].value.value))
    return texts


def shape_annotations(text: str) -> list[list[str]]:
    """The words of each bracketed shape in ``text``; brackets that are not shapes are skipped."""
    shapes = []
    for match in _BRACKET.finditer(text):
        items = [item.strip() for item in match.group(1).split(",")]
        if not all(_ITEM.match(item) for item in items):
            continue
        words = [word for item in items for word in _WORD.findall(item)]
        if any(word.isupper() or word in STAND_INS for word in words):
            shapes.append(words)
    return shapes


def test_legend_letters_are_single_capitals_explained_once():
    letters = legend_letters()
    assert {"B", "T", "S", "D", "N", "K", "H"} <= letters
    assert all(len(letter) == 1 and letter.isupper() for letter in letters)


def test_shape_parser_reads_shapes_and_skips_prose():
    assert shape_annotations("x: [B, 1, T, S] and [B, K, G * T, H]") == [
        ["B", "T", "S"], ["B", "K", "G", "T", "H"]]
    assert shape_annotations("[..., N + 1] [B, T - first_output, tables]") == [
        ["N"], ["B", "T", "first_output", "tables"]]
    assert shape_annotations("dict[str, int], x[index], [Cache, CacheLayerMixin], [x1 cos - x2 sin]") == []
    assert shape_annotations("cos [..., hd]; [d, 2 * attention_dim]") == [["hd"], ["d", "attention_dim"]]


@pytest.mark.parametrize("name", TWIN_FILES)
def test_shape_annotations_use_only_legend_letters(name):
    letters = legend_letters()
    found = []
    for line, text in prose((PACKAGE / name).read_text()):
        for words in shape_annotations(text):
            stray = [w for w in words if (w.isupper() and w not in letters) or w in STAND_INS]
            if stray:
                found.append(f"{name}:{line}: {stray} in [{', '.join(words)}]")
    assert not found, "shape annotations outside the axis legend:\n" + "\n".join(found)
