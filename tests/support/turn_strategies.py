"""Hypothesis strategies for generated Needle turns: well-formed tool-call turns, their near misses,
plain answers, and the ways a server cuts a text into deltas.

Shared by the pure parser's tests (tests/test_stream_parser.py) and the vLLM parser's
(tests/vllm_serving/test_vllm_tool_calls.py).
"""

import json

from hypothesis import strategies as st

from needle_hf.models.needle.chat_template import IM_END, THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START

MARKERS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, IM_END, "<|im_start|>")
# Pieces that make a parser's life hard: markers, their halves, JSON's own syntax, escapes, unicode.
NASTY = MARKERS + tuple(marker[: len(marker) // 2] for marker in MARKERS) + (
    '"', "\\", "\\\"", "[", "]", "{", "}", ",", ":", "\n", " ", "\t", "\u2028", "Zoë", "東京", "🙂", "\u00a0", "<", "|",
    "null", "[]", "{}", "NaN",
)

nasty_text = st.lists(st.one_of(st.sampled_from(NASTY), st.text(max_size=6)), max_size=6).map("".join)
names = st.one_of(st.sampled_from(["set_alarm", "send_message", "f"]), nasty_text.filter(bool))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=False, allow_infinity=False), nasty_text)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(nasty_text, inner, max_size=3)), max_leaves=8)
calls = st.lists(st.fixed_dictionaries({"name": names, "arguments": st.dictionaries(nasty_text, values, max_size=4)}),
                 max_size=3)
spaces = st.sampled_from(["", " ", "\n", " \n\t", "\u3000"])


@st.composite
def call_json(draw, payload):
    """The calls as a model might write them: compact or spaced, escaped or raw unicode."""
    compact = draw(st.booleans())
    return json.dumps(payload, ensure_ascii=draw(st.booleans()),
                      separators=(",", ":") if compact else (", ", ": "))


@st.composite
def tool_call_turns(draw):
    """(text, calls, reasoning): a well-formed tool-call turn and what it must parse to."""
    payload = draw(calls)
    reasoning = None
    text = draw(spaces)
    if draw(st.booleans()):
        thought = draw(nasty_text).replace(THINK_END, "").replace(IM_END, "")
        # the reasoning ends at the first </think>: one split across the end must not complete a marker
        while (thought + THINK_END).find(THINK_END) != len(thought) or (thought + THINK_END).find(IM_END) >= 0:
            thought = thought[:-1]
        text += THINK_START + thought + THINK_END + draw(spaces)
        reasoning = thought.strip()
    text += TOOL_CALL_START + draw(st.sampled_from(["", " ", "\n"])) + draw(call_json(payload))
    text += draw(spaces) + TOOL_CALL_END + draw(spaces)
    if draw(st.booleans()):
        text += IM_END + draw(st.sampled_from(["", "\n<|im_start|>user\nmore", "junk </tool_call>"]))
    return text, payload, reasoning


@st.composite
def near_misses(draw):
    """Texts around the format: a turn cut short, with something inserted, with text after, or plain text."""
    text, _, _ = draw(tool_call_turns())
    kind = draw(st.sampled_from(["truncate", "insert", "append", "plain", "think_then_text"]))
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text)))]
    if kind == "insert":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.one_of(st.sampled_from(NASTY), nasty_text)) + text[at:]
    if kind == "append":
        return text + draw(st.sampled_from([" and done", TOOL_CALL_START + "[]" + TOOL_CALL_END, "x", "<|im_end", "</"]))
    if kind == "plain":
        return draw(nasty_text)
    return THINK_START + draw(nasty_text) + THINK_END + draw(spaces) + draw(nasty_text)


outputs = st.one_of(tool_call_turns().map(lambda turn: turn[0]), near_misses())


@st.composite
def cut(draw, text):
    """``text`` cut into deltas at random points (empty deltas included, as servers send them)."""
    points = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    edges = [0, *points, len(text)]
    return [text[start:end] for start, end in zip(edges, edges[1:])]
