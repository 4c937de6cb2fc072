"""`ToolCallStream`: the streamed result equals the whole-text result, for every output and every cut.

Outputs are generated (`turn_strategies`): well-formed tool-call turns whose arguments hold markers,
quotes, escapes and unicode; the same turns cut short, with text inserted or appended; think blocks
followed by plain answers; plain text. Each is fed whole and in random deltas.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from turn_strategies import cut, outputs, tool_call_turns

from needle_hf.models.needle.chat_template import IM_END
from needle_hf.tools.tool_calls import ToolCallParseError, ToolCallStream, parse_assistant_turn

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)


def run(deltas):
    """(content, turn, error) of a stream fed ``deltas`` then finished; the turn must come exactly once."""
    stream = ToolCallStream()
    settled = [stream.feed(delta) for delta in deltas] + [stream.finish()]
    turns = [piece.turn for piece in settled if piece.turn is not None]
    assert len(turns) == (stream.turn is not None)
    assert (stream.turn is None) == (stream.error is not None)
    return "".join(piece.content for piece in settled), stream.turn


@settings(max_examples=600, deadline=None)
@given(data=st.data(), text=outputs)
def test_any_cut_of_any_output_streams_the_whole_texts_result(data, text):
    whole = run([text])
    assert run(data.draw(cut(text))) == whole
    assert run(list(text)) == whole  # one character at a time
    content, turn = whole
    if turn is None:
        with pytest.raises(ToolCallParseError):
            parse_assistant_turn(text)
        assert text.startswith(content)  # verbatim, up to the turn's <|im_end|>
        if IM_END not in text:
            assert content == text
    else:
        assert parse_assistant_turn(text) == turn and content == ""


@settings(max_examples=400, deadline=None)
@given(data=st.data(), turn=tool_call_turns())
def test_well_formed_turns_give_their_calls_whatever_their_arguments_hold(data, turn):
    text, calls, reasoning = turn
    content, parsed = run(data.draw(cut(text)))
    assert content == "" and parsed is not None
    assert parsed.tool_calls == calls and parsed.reasoning == reasoning


@pytest.mark.parametrize("text, content", [
    ("<think>\nwhy\n</think>\nThe alarm is set.", "<think>\nwhy\n</think>\nThe alarm is set."),
    ("<think>\nstill thinking", "<think>\nstill thinking"),
    ('<tool_call>[{"name":"f","arguments":{"q":"', '<tool_call>[{"name":"f","arguments":{"q":"'),
    ("<tool_call>[]</tool_call> and text", "<tool_call>[]</tool_call> and text"),
    ("<tool_call>[]</tool_call><tool_call>[]</tool_call>", "<tool_call>[]</tool_call><tool_call>[]</tool_call>"),
    ("Done.<|im_end|>\n<|im_start|>user", "Done."),
    ("Done.<|im_end|", "Done.<|im_end|"),
    ("<think>a<|im_end|>b</think><tool_call>[]</tool_call>", "<think>a"),  # the turn ended inside the think block
    ('<tool_call>[{"name":"f"}]<|im_end|></tool_call>', '<tool_call>[{"name":"f"}]'),
])
def test_outputs_that_are_not_tool_call_turns_stream_as_content(text, content):
    for size in (1, 2, 3, len(text)):
        streamed, turn = run([text[i:i + size] for i in range(0, len(text), size)])
        assert (streamed, turn) == (content, None)


@pytest.mark.parametrize("text, arguments", [
    ('<tool_call>[{"name":"f","arguments":{"q":"</tool_call>"}}]</tool_call>', {"q": "</tool_call>"}),
    ('<tool_call>[{"name":"f","arguments":{"q":"<|im_end|>x"}}]</tool_call><|im_end|>', {"q": "<|im_end|>x"}),
    ('<tool_call>[{"name":"f","arguments":{"q":"\\"]}<|im_end|"}}]</tool_call>', {"q": '"]}<|im_end|'}),
])
def test_markers_inside_argument_strings_stay_arguments(text, arguments):
    for size in (1, 4, len(text)):
        content, turn = run([text[i:i + size] for i in range(0, len(text), size)])
        assert content == "" and turn.tool_calls == [{"name": "f", "arguments": arguments}]


def test_content_streams_as_soon_as_it_cannot_be_a_tool_call_turn():
    stream = ToolCallStream()
    assert stream.feed(" <").content == ""  # may still be <tool_call>
    assert stream.feed("b>bold</b> <|im_").content == " <b>bold</b> "  # a split <|im_end|> is held back
    assert stream.feed("end|>after").content == ""
    assert stream.finish().content == ""


def test_calls_come_once_the_turn_is_known_to_end():
    stream = ToolCallStream()
    assert stream.feed('<tool_call>[{"name":"f","arguments":{}}]</tool_call>').turn is None  # text may follow
    assert stream.feed(IM_END).turn.tool_calls == [{"name": "f", "arguments": {}}]
    assert stream.finish() == type(stream.finish())()


def test_a_finished_stream_refuses_more_text():
    stream = ToolCallStream()
    stream.finish()
    with pytest.raises(ToolCallParseError, match="already finished"):
        stream.feed("x")
    with pytest.raises(ToolCallParseError, match="got bytes"):
        ToolCallStream().feed(b"x")
