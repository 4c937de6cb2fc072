"""The PyTorch model behind `pipeline("text-generation")`, on the trained demo checkpoint.

needle_hf/demo/needle2-demo.pkl is a small Needle 2 briefly trained (scripts/make_demo_checkpoint.py)
to answer tool-calling prompts with a tool call, so these tests can check what the pipeline
returns, not only that it runs. The suite also runs under transformers 5 (`.venv-v5`), where
`needle_hf.conversion` is not importable; the fixture then builds the same folder from the public
pieces (config, key map, safetensors, tokenizer builder).
"""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import needle_hf  # noqa: F401  (registers Needle with the Auto classes)
from needle_hf.tools.tool_calls import parse_tool_calls
from needle_hf.models.needle.tokenization_needle import save_fast_tokenizer
from needle_hf.models.needle.weight_names import native_to_hf, optional_heads_in_native

from demo_support import (  # noqa: F401  (demo_folder: fixture)
    DEMO_CHECKPOINT,
    DEMO_TOKENIZER,
    MAX_NEW_TOKENS,
    PLAY_MUSIC,
    SEND_MESSAGE,
    SET_ALARM,
    SET_TEMPERATURE,
    TOOL_QUERIES,
    demo_folder,
    load_demo_checkpoint,
)

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

REPO = Path(__file__).resolve().parents[2]
MAJOR_VERSION = int(transformers.__version__.split(".")[0])
# The other venv of this repository: the folder round trip crosses transformers 4 <-> 5.
OTHER_PYTHON = REPO / (".venv-v5" if MAJOR_VERSION < 5 else ".venv") / "bin" / "python"


@pytest.fixture(scope="module")
def generator(demo_folder):
    # Decoder-only batches need left padding; transformers 5's pipeline sets it, 4.57's does not.
    tokenizer = AutoTokenizer.from_pretrained(demo_folder, padding_side="left")
    return pipeline("text-generation", model=str(demo_folder), tokenizer=tokenizer, device="cpu")


def _tools_kwargs(tools):
    """`tools=` for the chat template: a pipeline argument on 5.x, a tokenizer argument on 4.57."""
    if MAJOR_VERSION >= 5:
        return {"tools": tools}
    return {"tokenizer_encode_kwargs": {"tools": tools}}


def _calls_of(record):
    """The tool calls of one chat pipeline record, `[{"name", "arguments"}]`.

    transformers 5.13+ parses the answer with the folder's `response_template` (the message holds
    `tool_calls`, no `content`); 4.57 returns the answer's text, read by `parse_tool_calls`.
    """
    reply = record["generated_text"][-1]
    assert reply["role"] == "assistant"
    if MAJOR_VERSION >= 5:
        assert "content" not in reply, reply
        return [call["function"] for call in reply.get("tool_calls", [])]
    return parse_tool_calls(reply["content"])


def test_chat_with_tools_returns_a_parseable_call_to_the_right_tool(generator):
    for tools, query, expected_tool in TOOL_QUERIES:
        records = generator([{"role": "user", "content": query}], max_new_tokens=MAX_NEW_TOKENS,
                            do_sample=False, **_tools_kwargs(tools))
        calls = _calls_of(records[0])
        assert [call["name"] for call in calls] == [expected_tool], f"{query!r} -> {records[0]!r}"


def test_chat_answer_ends_at_the_end_of_the_turn_without_the_marker(generator, demo_folder):
    from needle_hf.models.needle.tokenization_needle_fast import NeedleTokenizerFast

    tools, query, expected_tool = TOOL_QUERIES[0]
    tokenizer, model = generator.tokenizer, generator.model
    messages = [{"role": "user", "content": query}]
    # What the model writes, token by token: the turn, then <|im_end|> and EOS, where generation stops.
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    new_ids = model.generate(**prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert new_ids.tolist()[-2:] == [im_end_id, tokenizer.eos_token_id]
    turn = tokenizer.decode(new_ids[:-2], skip_special_tokens=False)  # every id as written, but the end
    assert "<|im_end|>" not in turn and turn.startswith("<tool_call>") and turn.endswith("</tool_call>")
    # The README's decode gives the same text (NeedleTokenizerFast hides the turn marker on every version).
    assert NeedleTokenizerFast.from_pretrained(demo_folder).decode(new_ids, skip_special_tokens=True) == turn

    record = generator(messages, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **_tools_kwargs(tools))[0]
    if MAJOR_VERSION >= 5:
        # The response_template parses the generated ids with the prompt as prefix, as parse_response does.
        assert record["generated_text"][-1] == tokenizer.parse_response(new_ids, prefix=prompt["input_ids"][0],
                                                                        tools=tools)
    else:
        # 4.57 cuts the decoded prompt's text off the decoded whole, which keeps the dummy-prefix space.
        assert record["generated_text"][-1]["content"] == " " + turn
    assert _calls_of(record) == parse_tool_calls(turn)
    assert [call["name"] for call in parse_tool_calls(turn)] == [expected_tool]


def test_batched_chats_give_the_answers_of_one_by_one(generator):
    # Two tools per prompt, as the demo was trained (one or two offered); prompts of different lengths.
    for tools, cases in (([SET_ALARM, SEND_MESSAGE], TOOL_QUERIES[:2]), ([SET_TEMPERATURE, PLAY_MUSIC], TOOL_QUERIES[2:])):
        chats = [[{"role": "user", "content": query}] for _, query, _ in cases]
        kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **_tools_kwargs(tools))
        single = [generator(chat, **kwargs)[0]["generated_text"][-1] for chat in chats]
        batched = [records[0]["generated_text"][-1] for records in generator(chats, batch_size=2, **kwargs)]
        assert batched == single
        for records, (_, _, expected_tool) in zip(generator(chats, batch_size=2, **kwargs), cases):
            assert [call["name"] for call in _calls_of(records[0])] == [expected_tool], records


def test_plain_text_prompt_matches_the_chat_answer(generator):
    tools, query, expected_tool = TOOL_QUERIES[0]
    tokenizer = generator.tokenizer
    messages = [{"role": "user", "content": query}]
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    # The template writes BOS itself; as plain text the tokenizer adds it, so pass the rest.
    assert rendered.startswith(tokenizer.bos_token)
    plain_prompt = rendered[len(tokenizer.bos_token):]
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    plain = generator(plain_prompt, return_full_text=False, **kwargs)[0]["generated_text"]
    chat_calls = _calls_of(generator(messages, **kwargs, **_tools_kwargs(tools))[0])
    assert parse_tool_calls(plain) == chat_calls
    assert [call["name"] for call in chat_calls] == [expected_tool]
    free_text = generator(["Hello there", "Play"], batch_size=2, **kwargs)
    assert all(isinstance(records[0]["generated_text"], str) for records in free_text)


# --------------------------------------------------------------------------------------------------
# A folder saved under one transformers version loads under the other.

PROBE_TEXT = "<|im_start|>user\n<tools>[]</tools>\nPlay Imagine, café 🎵<|im_end|>\n<|im_start|>assistant\n"

_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import needle_hf  # registers Needle with the Auto classes
    from needle_hf.models.needle.tokenization_needle import save_fast_tokenizer

    source, resave, results, text = sys.argv[1:5]
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    np.savez(results, ids=ids.numpy(), logits=logits.numpy(), version=transformers.__version__)
    model.save_pretrained(resave)
    save_fast_tokenizer(tokenizer, resave)  # 5.x's own save_pretrained names TokenizersBackend, unknown to 4.57
""")


def _ids_and_logits(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROBE_TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return ids.numpy(), model(input_ids=ids).logits.numpy()


@pytest.mark.skipif(not OTHER_PYTHON.exists(), reason=f"the other transformers venv ({OTHER_PYTHON}) is not set up")
def test_folder_saved_under_one_version_loads_under_the_other(demo_folder, tmp_path):
    ids, logits = _ids_and_logits(demo_folder)
    saved_here = tmp_path / "saved-here"
    AutoModelForCausalLM.from_pretrained(demo_folder).save_pretrained(saved_here)
    save_fast_tokenizer(AutoTokenizer.from_pretrained(demo_folder), saved_here)

    saved_there, results = tmp_path / "saved-there", tmp_path / "there.npz"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.run([str(OTHER_PYTHON), "-c", _CHILD, str(saved_here), str(saved_there), str(results), PROBE_TEXT],
                           env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    there = np.load(results)
    assert int(str(there["version"]).split(".")[0]) != MAJOR_VERSION, "the child ran the same transformers major"

    # Loaded there: same tokens, same logits.
    np.testing.assert_array_equal(there["ids"], ids)
    np.testing.assert_allclose(there["logits"], logits, rtol=0, atol=1e-5)
    # Saved there, loaded here: same again.
    back_ids, back_logits = _ids_and_logits(saved_there)
    np.testing.assert_array_equal(back_ids, ids)
    np.testing.assert_allclose(back_logits, logits, rtol=0, atol=1e-5)
    assert json.loads((saved_there / "config.json").read_text())["model_type"] == "needle2"


@pytest.mark.skipif(MAJOR_VERSION >= 5, reason="the Flax model needs transformers 4.x (5.x has no Flax)")
def test_pytorch_and_flax_generate_the_same_greedy_tokens(demo_folder):
    import jax
    from transformers import FlaxAutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(demo_folder)
    torch_model = AutoModelForCausalLM.from_pretrained(demo_folder).eval()
    flax_model = FlaxAutoModelForCausalLM.from_pretrained(demo_folder)
    flax_generate = jax.jit(lambda ids, p: flax_model.generate(ids, params=p, max_new_tokens=24, do_sample=False).sequences)
    for tools, query, _ in TOOL_QUERIES:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": query}], tools=tools, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="np")["input_ids"]
        with torch.no_grad():
            ours_torch = torch_model.generate(torch.as_tensor(ids), max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        ours_flax = np.asarray(flax_generate(ids, flax_model.params))[0, ids.shape[1]:].tolist()
        # Flax pads after EOS up to max_new_tokens; PyTorch stops at EOS.
        assert ours_flax[: len(ours_torch)] == ours_torch, query
        assert all(t == flax_model.generation_config.pad_token_id for t in ours_flax[len(ours_torch):]), query
