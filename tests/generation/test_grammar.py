"""Grammar-constrained tool calls (`needle_hf.generation.grammar`): every constrained answer parses and validates.

A tiny random model (no training) writes whatever its random logits say; with the processor its
answers must still be a well-formed Needle turn whose calls name given tools with arguments that
satisfy their schemas. The pipeline test runs the trained demo checkpoint.
"""

from __future__ import annotations

import jsonschema
import numpy as np
import pytest
import torch
import transformers
from needle_reference import TINY_NATIVE_CONFIG
from demo_support import demo_folder  # noqa: F401  (fixture: the demo as a HF folder, 4.57 and 5.x)
from transformers import AutoTokenizer, LogitsProcessorList, pipeline

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.generation.grammar import ToolCallGrammar, ToolGrammarError, token_bytes, tool_calls_json_schema, tool_schema
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.tools.tool_calls import parse_assistant_turn


TOOLS = [
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm.",
        "parameters": {"type": "object", "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "label": {"type": "string", "maxLength": 6},
            "repeat": {"type": "boolean"}},
            "required": ["hour"]}}},
    {"name": "set_mode", "description": "Pick a mode.",
     "parameters": {"type": "object", "properties": {
         "mode": {"enum": ["eco", "boost", "off"]},
         "level": {"type": "number", "minimum": 0, "maximum": 1},
         "zones": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
         "required": ["mode", "zones"]}},
]


pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]


@pytest.fixture(scope="module")
def tokenizer(demo_tokenizer):
    return demo_tokenizer


@pytest.fixture(scope="module")
def grammar(tokenizer):
    return ToolCallGrammar(tokenizer)


@pytest.fixture(scope="module")
def random_model(tokenizer):
    torch.manual_seed(0)
    config = NeedleConfig.from_needle_config({**TINY_NATIVE_CONFIG, "vocab_size": len(tokenizer), "max_seq_len": 512})
    return NeedleForCausalLM(config).eval()


def _prompt(tokenizer, tools, query="Wake me at 7 in eco mode."):
    text = tokenizer.apply_chat_template([{"role": "user", "content": query}], tools=tools,
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)


def _turn_text(tokenizer, ids):
    """The generated turn as written, markers included: the ids before the first EOS."""
    ids = list(ids)
    ids = ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
    return tokenizer.decode(ids, skip_special_tokens=False)


def _assert_valid_answer(text, tools):
    schemas = {schema["name"]: schema["parameters"] for schema in map(tool_schema, tools)}
    assert text.endswith("<|im_end|>"), text
    for call in parse_assistant_turn(text).tool_calls:
        assert call["name"] in schemas, text
        jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_token_bytes_keep_the_spaces_bytes_and_markers_of_the_pieces(tokenizer):
    tokens, special = token_bytes(tokenizer)
    assert tokens[tokenizer.convert_tokens_to_ids("\u2581")] == b" "
    assert tokens[tokenizer.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    spaced = next(i for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
                  if piece.startswith("\u2581") and len(piece) > 1)
    assert tokens[spaced].startswith(b" ")  # decoding the id alone would strip that space
    assert {0, 1, 2, 3, *range(4, 14)} <= set(special)
    assert tokens[10] == b"\xff<tool_call>"


@pytest.mark.parametrize("seed", range(6))
def test_sampled_answers_of_a_random_model_always_parse_and_validate(random_model, tokenizer, grammar, seed):
    inputs = _prompt(tokenizer, TOOLS)
    torch.manual_seed(seed)
    out = random_model.generate(
        **inputs, do_sample=True, temperature=1.5, max_new_tokens=160, num_return_sequences=3,
        logits_processor=LogitsProcessorList([grammar.logits_processor(TOOLS)]),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    for row in out[:, inputs["input_ids"].shape[1]:]:
        ids = row.tolist()
        assert tokenizer.eos_token_id in ids, "the grammar must end the answer well within 160 tokens"
        ids = ids[: ids.index(tokenizer.eos_token_id)]
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        _assert_valid_answer(_turn_text(tokenizer, ids), TOOLS)


def test_greedy_answers_of_a_left_padded_batch_validate(random_model, tokenizer, grammar):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": query}], tools=TOOLS,
                                           add_generation_prompt=True, tokenize=False)
             for query in ("Boost.", "Set an alarm at nine o'clock please, labelled gym.")]
    inputs = tokenizer(texts, return_tensors="pt", add_special_tokens=False, padding=True)
    out = random_model.generate(**inputs, do_sample=False, max_new_tokens=160,
                                logits_processor=LogitsProcessorList([grammar.logits_processor(TOOLS)]),
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    for row in out[:, inputs["input_ids"].shape[1]:]:
        _assert_valid_answer(_turn_text(tokenizer, row.tolist()), TOOLS)


def test_markers_are_asked_for_by_id_not_spelled_out(tokenizer, grammar):
    spelled = tokenizer.convert_tokens_to_ids(["<0x3C>"])  # "<" as a byte piece
    matcher = grammar.matcher(TOOLS)
    assert matcher.consume_token(tokenizer.convert_tokens_to_ids("\u2581"))
    assert not matcher.consume_token(spelled[0])


def test_schema_errors_name_the_tool():
    with pytest.raises(ToolGrammarError, match="names must be unique"):
        tool_calls_json_schema([TOOLS[1], TOOLS[1]])
    with pytest.raises(ToolGrammarError, match="'parameters' must be a JSON schema object"):
        tool_schema({"name": "x", "parameters": "nope"})
    assert tool_calls_json_schema([])["maxItems"] == 0


def test_pipeline_answers_with_the_processor_on_the_demo(demo_folder):  # noqa: F811
    tokenizer = AutoTokenizer.from_pretrained(demo_folder)
    generator = pipeline("text-generation", model=str(demo_folder), tokenizer=tokenizer, device="cpu")
    tools = [TOOLS[0]["function"] | {"name": "set_alarm"}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Set an alarm for 6."}], tools=tools,
                                           add_generation_prompt=True, tokenize=False)
    kwargs = dict(max_new_tokens=48, do_sample=False, return_full_text=False,
                  logits_processor=LogitsProcessorList([ToolCallGrammar(tokenizer).logits_processor(tools)]))
    # Every token as written, to see the turn closed: "<|im_end|>" then EOS.
    written = generator(prompt, skip_special_tokens=False, **kwargs)[0]["generated_text"]
    assert written.endswith(tokenizer.eos_token), written
    _assert_valid_answer(written.removesuffix(tokenizer.eos_token), tools)
    answer = generator(prompt, **kwargs)[0]["generated_text"]
    if int(transformers.__version__.split(".")[0]) >= 5:
        # The folder's response_template makes 5.x's pipeline keep every token (it parses chat answers).
        assert answer == written
    else:
        # The answer as the pipeline gives it ends with the turn, without the marker.
        assert answer == written.removesuffix("<|im_end|>" + tokenizer.eos_token)


@pytest.mark.skipif(not hasattr(transformers, "FlaxPreTrainedModel"), reason="transformers 5 has no Flax")
def test_flax_generate_with_the_processor_names_only_offered_tools(demo_folder):  # noqa: F811
    import numpy as np
    from transformers import FlaxLogitsProcessorList

    from needle_hf.generation.grammar import FlaxToolCallLogitsProcessor
    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    model = FlaxNeedleForCausalLM.from_pretrained(demo_folder)
    tokenizer = AutoTokenizer.from_pretrained(demo_folder)
    tools = [TOOLS[0]]  # the query asks for music, a tool that is not offered
    inputs = _prompt(tokenizer, tools, query="Play Yesterday.")
    ids, mask = inputs["input_ids"].numpy(), inputs["attention_mask"].numpy()
    processor = FlaxToolCallLogitsProcessor(ToolCallGrammar(tokenizer), tools)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, trace=False,
                         logits_processor=FlaxLogitsProcessorList([processor]))
    _assert_valid_answer(_turn_text(tokenizer, np.asarray(out.sequences)[0, ids.shape[1]:].tolist()), tools)


def test_masks_cover_a_model_wider_than_the_tokenizer(demo_tokenizer):
    """A model whose logits outnumber the tokenizer's pieces: the extra ids are never allowed."""
    tools = [{"name": "ping", "parameters": {"type": "object", "properties": {}}}]
    wide = ToolCallGrammar(demo_tokenizer, vocab_size=len(demo_tokenizer) + 1000)
    masks = wide.logits_processor(tools).masks(np.zeros((2, 3), dtype=np.int64))
    assert masks.shape == (2, len(demo_tokenizer) + 1000)
    assert masks[:, : len(demo_tokenizer)].any() and not masks[:, len(demo_tokenizer):].any()
