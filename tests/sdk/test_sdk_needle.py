"""`needle_hf.Needle` end to end on both twins: the envelope, the agent loop, extraction, retrieval.

The model is the shipped demo checkpoint (a reference-format `.pkl` trained on five phone tools,
every head present) converted to a Hugging Face folder, so answers are real calls: ``set_alarm``
for an alarm request. The tools are Python functions whose schemas equal the demo's training tools.
"""

from __future__ import annotations

import math
import os

import pytest
import transformers

import needle_hf
from needle_hf.demo.data import DEMO_DATA_TOOLS
from needle_hf.sdk import validation
from demo_support import DEMO_CHECKPOINT, DEMO_TOKENIZER, build_folder_without_converter

HAS_FLAX = hasattr(transformers, "FlaxAutoModelForCausalLM")
TWINS = ["pt", pytest.param("flax", marks=pytest.mark.skipif(not HAS_FLAX, reason="transformers 5 has no Flax"))]
ENVELOPE_KEYS = {"type", "success", "error", "error_code", "function_calls", "reasoning", "confidence", "validation",
                 "prefill_tps", "decode_tps", "peak_ram_mb"}
ERROR_CODES = {None, "malformed", "truncated", "context_length"}
MAX_NEW_TOKENS = 40

pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]


def assert_envelope(envelope: dict, offered_names=None) -> None:
    """The envelope's keys, types and invariants (see `needle_hf.sdk.needle`)."""
    assert ENVELOPE_KEYS <= set(envelope), sorted(ENVELOPE_KEYS - set(envelope))
    assert envelope["type"] in ("call", "respond")
    assert isinstance(envelope["success"], bool) and envelope["error_code"] in ERROR_CODES
    assert (envelope["error"] is None) == envelope["success"] == (envelope["error_code"] is None)
    calls = envelope["function_calls"]
    assert isinstance(calls, list) and (envelope["type"] == "call") == bool(calls)
    for call in calls:
        assert set(call) == {"name", "arguments"} and isinstance(call["name"], str) and isinstance(call["arguments"], dict)
        if offered_names is not None:
            assert call["name"] in offered_names
    assert isinstance(envelope["reasoning"], str)
    confidence = envelope["confidence"]
    assert confidence is None or (0.0 <= confidence <= 1.0 and not math.isnan(confidence))
    assert envelope["success"] or confidence is None
    check = envelope["validation"]
    assert set(check) == {"ungrounded", "negation"} and isinstance(check["negation"], bool)
    assert all(isinstance(path, str) and path.split(".")[0] in {c["name"] for c in calls} for path in check["ungrounded"])
    for key in ("prefill_tps", "decode_tps", "peak_ram_mb"):
        assert isinstance(envelope[key], float) and envelope[key] >= 0.0


# Python tools whose schemas are the demo's training tools.
CALLS: list = []


def set_alarm(time: str):
    """Set an alarm on the phone.

    Args:
        time: HH:MM, 24-hour clock
    """
    CALLS.append(("set_alarm", time))
    return {"ok": True, "time": time}


def send_message(to: str, text: str):
    """Send a text message to a contact.

    Args:
        to: Name of the contact.
        text: Text to send.
    """
    raise ConnectionError(f"no network to reach {to}")


def play_music(song: str):
    """Play a song.

    Args:
        song: Song title.
    """
    return {"playing": song}


def set_temperature(degrees: int):
    """Set the thermostat.

    Args:
        degrees: Target temperature in Celsius.
    """
    return {"degrees": degrees}


def get_weather(city: str):
    """Get the weather forecast for a city."""
    return {"city": city, "sky": "clear"}


DEMO_FUNCTIONS = [set_alarm, send_message, play_music, set_temperature, get_weather]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("sdk") / "needle2-hf"
    try:
        from needle_hf.conversion.convert import convert
    except ImportError:  # transformers 5 venv: the converter is not installed there
        build_folder_without_converter(out)
    else:
        convert(DEMO_CHECKPOINT, out, tokenizer=DEMO_TOKENIZER)
    return str(out)


@pytest.fixture(scope="module")
def agents(folder):
    """One agent per twin, built on first use (the Flax one compiles)."""
    built = {}

    def get(framework):
        if framework not in built:
            built[framework] = needle_hf.Needle(folder, tools=DEMO_FUNCTIONS, framework=framework)
        return built[framework]

    return get


def test_demo_functions_give_the_demo_tool_schemas():
    assert [needle_hf.build_schema(f) for f in DEMO_FUNCTIONS] == DEMO_DATA_TOOLS


QUERIES = ["Set an alarm for 6:30.", "Wake me up at 7am", "don't set an alarm at 6:30", "Tell Bob I'm late"]


@pytest.fixture(scope="module")
def envelopes(agents):
    """{framework: [envelope per query]}, each query after a reset."""
    out = {}
    for framework in ("pt", "flax") if HAS_FLAX else ("pt",):
        agent = agents(framework)
        out[framework] = []
        for query in QUERIES:
            agent.reset()
            out[framework].append(agent.complete(query, MAX_NEW_TOKENS))
    return out


@pytest.mark.parametrize("framework", TWINS)
def test_complete_returns_a_well_formed_envelope(envelopes, framework):
    for envelope in envelopes[framework]:
        assert_envelope(envelope, {f.__name__ for f in DEMO_FUNCTIONS})
    alarm = envelopes[framework][0]
    assert alarm["type"] == "call" and alarm["success"]
    assert alarm["function_calls"] == [{"name": "set_alarm", "arguments": {"time": "6:30"}}]
    assert alarm["validation"] == {"ungrounded": [], "negation": False}
    assert envelopes[framework][2]["validation"]["negation"] is True


@pytest.mark.skipif(not HAS_FLAX, reason="transformers 5 has no Flax")
def test_twins_give_the_same_envelopes(envelopes):
    for pt, flax in zip(envelopes["pt"], envelopes["flax"]):
        for key in ("type", "success", "error_code", "function_calls", "reasoning", "validation"):
            assert pt[key] == flax[key], key
        assert (pt["confidence"] is None) == (flax["confidence"] is None)
        if pt["confidence"] is not None:
            assert abs(pt["confidence"] - flax["confidence"]) < 1e-4


def test_confidence_is_the_head_capped_by_the_answer_tokens(agents):
    agent = agents("pt")
    agent.reset()
    envelope = agent.complete(QUERIES[0], MAX_NEW_TOKENS)
    backend = agent._backend
    assert backend.has_confidence_head
    # Re-derive: generate the same answer and combine the two signals by hand.
    agent.reset()
    agent._messages.append({"role": "user", "content": QUERIES[0]})
    agent._offered = agent._route(QUERIES[0])
    prompt = agent._prompt_ids(MAX_NEW_TOKENS)
    generation = backend.generate([prompt], max_new_tokens=MAX_NEW_TOKENS, tools=agent._offered)[0]
    head = backend.confidence([prompt + generation.ids])[0]
    assert envelope["confidence"] == pytest.approx(min(head, min(generation.token_probs)), abs=1e-6)


def query_prompts(agent) -> list[list[int]]:
    """The prompt ids ``agent`` sends for each of `QUERIES` (its tools routed per query), one per query."""
    prompts = []
    for query in QUERIES:
        agent.reset()
        agent._messages.append({"role": "user", "content": query})
        agent._offered = agent._route(query)
        prompts.append(agent._prompt_ids(MAX_NEW_TOKENS))
    return prompts


def test_the_decoding_loop_gives_generate_s_tokens_and_reads_the_confidence_on_the_way(agents):
    """The PyTorch backend's greedy loop equals `generate()` with the grammar's logits processor on a
    left-padded batch (tokens exactly, token probabilities to 1e-6), and the confidence it reads off
    the decoding forwards equals the head run afresh on prompt + answer."""
    import torch
    from transformers import LogitsProcessorList

    agent = agents("pt")
    backend = agent._backend
    prompts = query_prompts(agent)
    assert len(set(map(len, prompts))) > 1  # the batch is left-padded
    generations = backend.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, tools=agent._offered)
    ids, mask = backend._left_padded(prompts, max(map(len, prompts)))
    eos = backend.eos_token_id
    with torch.no_grad():
        out = backend.model.generate(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False, logits_processor=LogitsProcessorList([backend._processor(agent._offered)]),
            return_dict_in_generate=True, output_scores=True, eos_token_id=eos, pad_token_id=backend.pad_token_id)
    assert any(generation.finished for generation in generations)
    for row, generation in enumerate(generations):
        expected = out.sequences[row, ids.shape[1]:].tolist()
        answer = expected[: expected.index(eos)] if eos in expected else expected
        assert generation.ids == answer and generation.finished == (eos in expected)
        probs = [float(torch.softmax(out.scores[step][row], dim=-1)[token]) for step, token in enumerate(answer)]
        assert generation.token_probs == pytest.approx(probs, abs=1e-6)
        if generation.finished:
            afresh = backend.confidence([prompts[row] + generation.ids])[0]
            assert generation.confidence == pytest.approx(afresh, abs=1e-5)
        else:
            assert generation.confidence is None


def test_compile_runs_the_same_loop_through_the_compiled_steps(folder, agents):
    """`compile=True`: the loop over a static cache, each step after the prompt through the model's
    compiled call, gives the plain loop's answers on a left-padded batch and reads the confidence
    off its steps (compiled products sum in another order: probabilities to 1e-3)."""
    plain = agents("pt")
    compiled = needle_hf.Needle(folder, tools=DEMO_FUNCTIONS, compile=True)
    prompts = query_prompts(plain)
    want = plain._backend.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, tools=plain._offered)
    got = compiled._backend.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, tools=plain._offered)
    assert compiled._backend.model._compiled_call.programs  # the steps ran compiled programs
    assert any(generation.finished for generation in want)
    for expected, generation in zip(want, got):
        assert generation.ids == expected.ids and generation.finished == expected.finished
        assert generation.token_probs == pytest.approx(expected.token_probs, abs=1e-3)
        assert (generation.confidence is None) == (expected.confidence is None)
        if expected.confidence is not None:
            assert generation.confidence == pytest.approx(expected.confidence, abs=1e-3)


@pytest.mark.skipif(not HAS_FLAX, reason="transformers 5 has no Flax")
def test_the_flax_loop_reads_the_confidence_off_its_decoding_steps(agents, monkeypatch):
    """On a left-padded batch the Flax backend's confidence, read off the cells its prefill and decoding
    steps return, equals the head run afresh on prompt + answer (to 1e-5), without that second forward."""
    agent = agents("flax")
    backend = agent._backend
    prompts = query_prompts(agent)
    assert len(set(map(len, prompts))) > 1  # the batch is left-padded
    second_forwards = []
    afresh = backend.confidence
    monkeypatch.setattr(backend, "confidence", lambda rows: second_forwards.append(rows) or afresh(rows))
    generations = backend.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, tools=agent._offered)
    assert any(generation.finished for generation in generations)
    for row, generation in enumerate(generations):
        if generation.finished:
            assert generation.confidence == pytest.approx(afresh([prompts[row] + generation.ids])[0], abs=1e-5)
        else:
            assert generation.confidence is None
    # A second call of the same shape reuses the empty cache (making one traces the whole model).
    made = []
    init_cache = backend.model.init_cache
    monkeypatch.setattr(backend.model, "init_cache", lambda *shape: made.append(shape) or init_cache(*shape))
    again = backend.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, tools=agent._offered)
    assert made == [] and [g.ids for g in again] == [g.ids for g in generations]
    assert [g.confidence for g in again] == [g.confidence for g in generations]
    # Each decoding step hands its input cache over to XLA (donated: written in place, not copied);
    # the kept empty cache, which the prefill step reads, stays alive for the next call.
    import jax

    handed = []
    decoding_step = backend._decoding_step
    monkeypatch.setattr(backend, "_decoding_step", lambda *args: handed.append(args[4]) or decoding_step(*args))
    assert [g.ids for g in backend.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, tools=agent._offered)] == \
        [g.ids for g in generations]
    assert handed and all(leaf.is_deleted() for cache in handed for leaf in jax.tree_util.tree_leaves(cache))
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(backend._empty[1]))
    agent.reset()
    envelope = agent.complete(QUERIES[next(row for row, g in enumerate(generations) if g.finished)], MAX_NEW_TOKENS)
    assert second_forwards == [] and (envelope["confidence"] is not None) == envelope["success"]


@pytest.mark.parametrize("framework", TWINS)
def test_run_calls_the_function_and_feeds_the_result_back(agents, framework):
    agent = agents(framework)
    agent.reset()
    CALLS.clear()
    result = agent.run("Set an alarm for 6:30.", max_steps=2, max_new_tokens=MAX_NEW_TOKENS)
    assert_envelope(result)
    assert CALLS[0] == ("set_alarm", "6:30")
    assert result["results"][0] == {"ok": True, "time": "6:30"}
    assert len(result["results"]) == len(CALLS) <= 2 * 5
    # The result went back to the model as a tool turn, rendered as the next user turn.
    tool_turns = [m for m in agent._messages if m["role"] == "tool"]
    assert tool_turns[0] == {"role": "tool", "name": "set_alarm", "content": '{"ok":true,"time":"6:30"}'}
    prompt = agent._backend.tokenizer.decode(agent._prompt_ids(0))
    assert '<tool_result>[{"ok":true,"time":"6:30"}]</tool_result>' in prompt
    assert prompt.count("<tools>") == 1


def test_run_turns_failures_into_error_results(folder, agents):
    backend = agents("pt")._backend
    # A schema with no function behind it, and a function that raises.
    no_function = needle_hf.Needle(backend, tools=[DEMO_DATA_TOOLS[0]])
    result = no_function.run("Set an alarm for 6:30.", max_steps=1, max_new_tokens=MAX_NEW_TOKENS)
    assert result["results"] == [{"error": "unknown tool: set_alarm"}]

    def set_alarm(time: str):  # noqa: F811  (same name, a function that fails)
        """Set an alarm on the phone.

        Args:
            time: HH:MM, 24-hour clock
        """
        raise RuntimeError("the clock app is closed")

    raising = needle_hf.Needle(backend, tools=[set_alarm])
    assert raising.run("Set an alarm for 6:30.", max_steps=1, max_new_tokens=MAX_NEW_TOKENS)["results"] == [
        {"error": "the clock app is closed"}]


def test_strict_run_refuses_ungrounded_arguments(agents):
    agent = agents("pt")
    agent.reset()
    first = agent.complete("Wake me up at 7am", MAX_NEW_TOKENS)
    (call,) = first["function_calls"]
    assert call["name"] == "set_alarm"
    grounded = validation.GroundingSources(["Wake me up at 7am"]).has_string(call["arguments"]["time"])
    assert first["validation"]["ungrounded"] == ([] if grounded else ["set_alarm.time"])
    CALLS.clear()
    agent.reset()
    strict = agent.run("Wake me up at 7am", max_steps=1, max_new_tokens=MAX_NEW_TOKENS)
    if grounded:
        assert strict["results"] == [{"ok": True, "time": call["arguments"]["time"]}]
    else:
        assert strict["results"] == [{"error": "ungrounded time"}] and CALLS == []
        agent.reset()
        loose = agent.run("Wake me up at 7am", max_steps=1, max_new_tokens=MAX_NEW_TOKENS, strict=False)
        assert loose["results"] == [{"ok": True, "time": call["arguments"]["time"]}]


def test_reset_forgets_the_conversation(agents):
    agent = agents("pt")
    agent.reset()
    agent.complete("Set an alarm for 6:30.", MAX_NEW_TOKENS)
    agent.complete("Also one for 7:45.", MAX_NEW_TOKENS)
    assert [m["role"] for m in agent._messages] == ["user", "assistant", "user", "assistant"]
    assert "45" in agent._sources.words
    agent.reset()
    assert agent._messages == [] and "45" not in agent._sources.words


def test_long_conversations_drop_the_oldest_exchanges(agents):
    agent = agents("pt")
    agent.reset()
    for index in range(3):
        agent._messages += [{"role": "user", "content": f"Set an alarm for {index}:30. " * 40},
                            {"role": "assistant", "tool_calls": []}]
    agent._messages.append({"role": "user", "content": "Set an alarm for 6:30."})
    limit = agent._backend.max_positions
    ids = agent._prompt_ids(limit - 300)
    assert ids is not None and len(ids) <= 300
    assert agent._backend.tokenizer.decode(ids).count("<tools>") == 1
    assert agent._prompt_ids(limit) is None


def test_extract_returns_the_arguments_and_checks_them(folder, agents):
    from pydantic import BaseModel

    class Alarm(BaseModel):
        """Set an alarm on the phone."""

        time: str

    backend = agents("pt")._backend
    alarm = needle_hf.extract("Set an alarm for 6:30.", Alarm, model=backend)
    assert isinstance(alarm, Alarm) and alarm.time == "6:30"
    assert needle_hf.extract("Set an alarm for 6:30.", set_alarm, model=backend) == {"time": "6:30"}
    agent = needle_hf.Needle(backend, tools=DEMO_FUNCTIONS)
    assert agent.extract("Set an alarm for 6:30.", Alarm).time == "6:30"
    with pytest.raises(needle_hf.ExtractionValidationError, match="negated request"):
        agent.extract("don't set an alarm at 6:30", Alarm)
    assert agent.extract("don't set an alarm at 6:30", Alarm, strict=False).time == "6:30"


def test_retrieval_offers_the_top_five_tools(folder, agents):
    backend = agents("pt")._backend
    extra = [{"name": f"tool_{i}", "description": f"Unrelated tool number {i}.",
              "parameters": {"type": "object", "properties": {}}} for i in range(4)]
    catalogue = DEMO_FUNCTIONS + extra
    agent = needle_hf.Needle(backend, tools=catalogue)
    envelope = agent.complete("Set an alarm for 6:30.", MAX_NEW_TOKENS)
    offered = [schema["name"] for schema in agent._offered]
    assert len(offered) == 5
    assert offered == [s["name"] for s in agent.tools if s["name"] in offered]  # catalogue order
    # The head's own ranking decides: the five closest by cosine similarity.
    embeddings, _ = backend.embed([needle_hf.sdk.needle._tool_text(s) for s in agent.tools])
    query, _ = backend.embed(["Set an alarm for 6:30."])
    ranked = sorted(range(len(catalogue)), key=lambda i: -float(embeddings[i] @ query[0]))[:5]
    assert set(offered) == {agent.tools[i]["name"] for i in ranked}
    assert_envelope(envelope, set(offered))
    prompt = backend.tokenizer.decode(agent._prompt_ids(0))
    assert all((f'"name":"{name}"' in prompt) == (name in offered) for name in (s["name"] for s in agent.tools))
    every = needle_hf.Needle(backend, tools=catalogue, top_k_tools=None)
    every.complete("Set an alarm for 6:30.", MAX_NEW_TOKENS)
    assert len(every._offered) == 9


def test_grammar_is_on_by_default_and_off_with_a_flag(folder, agents):
    assert agents("pt")._backend.grammar is not None
    free = needle_hf.Needle(folder, tools=DEMO_FUNCTIONS, grammar=False)
    assert free._backend.grammar is None
    assert_envelope(free.complete("Set an alarm for 6:30.", MAX_NEW_TOKENS))


def test_bad_arguments_get_clear_errors(folder):
    with pytest.raises(ValueError, match="model: name a converted Needle folder"):
        needle_hf.Needle(tools=DEMO_FUNCTIONS)
    with pytest.raises(ValueError, match="framework: expected one of"):
        needle_hf.Needle(folder, framework="tf")
    with pytest.raises(ValueError, match="top_k_tools: expected a positive int or None"):
        needle_hf.Needle(folder, top_k_tools=0)
    with pytest.raises(ValueError, match="cpu_threads: expected a positive int"):
        needle_hf.Needle(folder, cpu_threads=0)
    with pytest.raises(TypeError, match="system: expected a str, got int"):
        needle_hf.Needle(folder, system=5)
    with pytest.raises(TypeError, match="model: expected a converted Needle folder, a Hub id or a loaded Needle model, got int"):
        needle_hf.Needle(5)
    with pytest.raises(TypeError, match="compile: expected True or False, got 'yes'"):
        needle_hf.Needle(folder, compile="yes")
    with pytest.raises(TypeError, match="grammar: expected True or False, got None"):
        needle_hf.Needle(folder, grammar=None)
    with pytest.raises(TypeError, match="tokenizer: expected a tokenizer, or a folder or Hub id holding one, got int"):
        needle_hf.Needle(folder, tokenizer=5)
    with pytest.raises(FileNotFoundError, match="tokenizer: no folder at /no/such/tokenizer"):
        needle_hf.Needle(folder, tokenizer="/no/such/tokenizer")
    with pytest.raises(ValueError, match="device: "):
        needle_hf.Needle(folder, device="no-such-device")
    assert needle_hf.Needle(folder, tokenizer=folder).complete("Set an alarm for 6:30.", MAX_NEW_TOKENS)["success"]
    from needle_hf.generation.grammar import ToolGrammarError

    bad_parameters = {"name": "x", "parameters": {"type": "object", "properties": {"a": 5}}}
    with pytest.raises(ToolGrammarError, match=r"tools\[1\]: tool x: parameters/properties/a: expected a schema"):
        needle_hf.Needle(folder, tools=[set_alarm, bad_parameters])
    needle_hf.Needle(folder, tools=[set_alarm, bad_parameters], grammar=False)  # no grammar: taken as written


def test_model_names_that_are_no_model_get_clear_errors(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="model: no folder at /no/such/folder, and it is not a Hub id"):
        needle_hf.Needle("/no/such/folder", tools=DEMO_FUNCTIONS)
    with pytest.raises(ValueError, match="has no config.json: expected a converted Needle folder"):
        needle_hf.Needle(str(tmp_path), tools=DEMO_FUNCTIONS)
    weights = os.path.join(folder, "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors is a file, expected a converted Needle folder"):
        needle_hf.Needle(weights, tools=DEMO_FUNCTIONS)


def test_bad_call_arguments_get_clear_errors_and_leave_the_conversation_alone(agents):
    agent = agents("pt")
    agent.reset()
    agent.complete("Set an alarm for 6:30.", MAX_NEW_TOKENS)
    before = (list(agent._messages), set(agent._sources.words), set(agent._sources.numbers))
    calls = [
        (TypeError, "text: expected a str, got NoneType", lambda: agent.complete(None)),
        (TypeError, "text: expected a str, got int", lambda: agent.complete(5)),
        (ValueError, "max_new_tokens: expected an int >= 1, found 0", lambda: agent.complete("hi", 0)),
        (ValueError, "max_new_tokens: expected an int >= 1, found True", lambda: agent.complete("hi", True)),
        (TypeError, "query: expected a str, got list", lambda: agent.run(["hi"])),
        (ValueError, "max_steps: expected an int >= 0, found -1", lambda: agent.run("hi", max_steps=-1)),
        (TypeError, "queries: expected a list of str, got str", lambda: agent.complete_batch("hi")),
        (TypeError, r"queries\[1\]: expected a str, got int", lambda: agent.complete_batch(["hi", 2])),
        (TypeError, "schema: expected a function, a pydantic model or a schema dict, got int",
         lambda: agent.extract("hi", 42)),
        (ValueError, "schema: a tool schema needs a non-empty string 'name'",
         lambda: agent.extract("hi", {"type": "object"})),
    ]
    for error, message, call in calls:
        with pytest.raises(error, match=message):
            call()
        assert (agent._messages, agent._sources.words, agent._sources.numbers) == before


@pytest.mark.parametrize("failure", [RuntimeError("the decoder failed"), KeyboardInterrupt()])
def test_a_call_that_raises_midway_leaves_the_conversation_as_it_was(agents, monkeypatch, failure):
    """An exception or an interrupt inside the generation (after the user turn was taken in) puts the
    turns, the grounding texts and the years back: the next call answers as if it never happened."""
    agent = agents("pt")
    agent.reset()
    first = agent.complete("Set an alarm for 6:30.", MAX_NEW_TOKENS)
    state = lambda: (list(agent._messages), set(agent._sources.words), set(agent._sources.numbers),
                     set(agent._seen_years), agent._last_query)
    before = state()

    def failing(*args, **kwargs):
        raise failure

    with monkeypatch.context() as patch:
        patch.setattr(agent._backend, "generate", failing)
        for call in (lambda: agent.complete("Also one for 7:45 in 2031.", MAX_NEW_TOKENS),
                     lambda: agent.run("Also one for 7:45 in 2031.", max_new_tokens=MAX_NEW_TOKENS)):
            with pytest.raises(type(failure)):
                call()
            assert state() == before
    second = agent.complete("Also one for 7:45.", MAX_NEW_TOKENS)
    assert [m["role"] for m in agent._messages] == ["user", "assistant", "user", "assistant"]
    agent.reset()
    agent.complete("Set an alarm for 6:30.", MAX_NEW_TOKENS)
    assert agent.complete("Also one for 7:45.", MAX_NEW_TOKENS)["function_calls"] == second["function_calls"]
    assert first["type"] in ("call", "respond")


def test_a_folder_with_only_a_sentencepiece_model_gets_its_tokenizer_built(folder, envelopes, tmp_path):
    """The reference's way of shipping a tokenizer (one `tokenizer.model`): the SDK builds the fast
    tokenizer from it and answers as the converted folder does; no tokenizer at all is a clear error."""
    import shutil

    bare = tmp_path / "weights-and-sentencepiece"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(f"{folder}/{name}", bare / name)
    with pytest.raises(ValueError, match=r"weights-and-sentencepiece: no tokenizer: expected tokenizer.json \+ "
                                         r"tokenizer_config.json or a SentencePiece tokenizer.model, found neither"):
        needle_hf.Needle(str(bare), tools=DEMO_FUNCTIONS)
    shutil.copyfile(DEMO_TOKENIZER, bare / "tokenizer.model")
    agent = needle_hf.Needle(str(bare), tools=DEMO_FUNCTIONS)
    for query, converted in zip(QUERIES, envelopes["pt"]):
        agent.reset()
        envelope = agent.complete(query, MAX_NEW_TOKENS)
        assert (envelope["function_calls"], envelope["reasoning"]) == (converted["function_calls"], converted["reasoning"])
        assert envelope["confidence"] == pytest.approx(converted["confidence"], abs=1e-6)
