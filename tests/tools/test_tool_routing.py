"""Tool routing and answer confidence (`needle_hf.tools.tool_routing`) against the reference heads.

Parameters are reference-shaped with every leaf perturbed (`needle_reference`); the reference's
`forward_contrastive` / `forward_confidence` run on the same token ids, one text at a time, while
needle-hf embeds left-padded batches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.tools.tool_routing import NeedleToolCaller, answer_confidence, embed_tools, rank_tools, select_tools, tool_text
from needle_hf.models.needle.weight_names import native_to_hf

TOLERANCE = 1e-4
REFERENCE_WIDTH = 160  # tokens; longer than every text here


def _tool(name, description, **properties):
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()},
                           "required": list(properties)}}


CATALOGUE = [
    _tool("set_alarm", "Set an alarm on the phone.", time="string"),
    {"type": "function", "function": _tool("send_message", "Send a text message to a contact.", to="string",
                                           text="string")},
    _tool("play_music", "Play a song.", song="string"),
    _tool("set_temperature", "Set the thermostat.", degrees="integer"),
    _tool("get_weather", "Get the weather forecast for a city.", city="string"),
]
QUERY = "Text Alice that I'm running late."


pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]


@pytest.fixture(scope="module")
def tokenizer(demo_tokenizer):
    return demo_tokenizer


@pytest.fixture(scope="module")
def native(tokenizer):
    return {**TINY_NATIVE_CONFIG, "vocab_size": len(tokenizer), "max_seq_len": 512}


@pytest.fixture(scope="module")
def params(native):
    return make_native_params(native, seed=3)


@pytest.fixture(scope="module")
def model(native, params):
    config = NeedleConfig.from_needle_config(native, use_contrastive_head=True, use_confidence_head=True)
    model = NeedleForCausalLM(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in native_to_hf(params, config).items()}, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def reference(native, params):
    import jax
    import jax.numpy as jnp
    from needle.model.architecture import SimpleAttentionNetwork

    network = SimpleAttentionNetwork(reference_config(native))
    contrastive_fn = jax.jit(lambda p, q, t: network.apply({"params": p}, q, t, method=network.forward_contrastive))
    confidence_fn = jax.jit(lambda p, t: network.apply({"params": p}, t, method=network.forward_confidence))
    contrastive = lambda q, t: contrastive_fn(params, q, t)  # noqa: E731
    confidence = lambda t: confidence_fn(params, t)  # noqa: E731

    def right_padded(rows):
        """One fixed width for every call (one compile); right padding leaves the real positions as they are."""
        assert max(map(len, rows)) <= REFERENCE_WIDTH
        return jnp.asarray([row + [0] * (REFERENCE_WIDTH - len(row)) for row in rows], jnp.int32)

    def similarities(tokenizer, query, tools):
        """Reference cosine similarity of the query with each tool."""
        q = right_padded([tokenizer(query).input_ids])
        t = right_padded([tokenizer(tool_text(tool)).input_ids for tool in tools])
        q_emb, t_emb, log_temp = contrastive(q, t)
        return np.asarray(q_emb @ t_emb.T)[0], float(log_temp)

    def confidence_logit(ids):
        return float(confidence(right_padded([ids]))[0])

    return similarities, confidence_logit


def test_ranking_matches_the_reference_contrastive_head(model, tokenizer, reference):
    expected, log_temp = reference[0](tokenizer, QUERY, CATALOGUE)
    ranked = rank_tools(model, tokenizer, QUERY, CATALOGUE)
    assert [entry.index for entry in ranked] == list(np.argsort(-expected, kind="stable"))
    found = np.asarray([entry.similarity for entry in sorted(ranked, key=lambda e: e.index)])
    np.testing.assert_allclose(found, expected, atol=TOLERANCE)
    probabilities = np.exp(expected / np.exp(log_temp)) / np.exp(expected / np.exp(log_temp)).sum()
    np.testing.assert_allclose([e.probability for e in sorted(ranked, key=lambda e: e.index)], probabilities,
                               atol=TOLERANCE)


def test_top_k_keeps_the_best_tools_in_catalogue_order(model, tokenizer, reference):
    expected, _ = reference[0](tokenizer, QUERY, CATALOGUE)
    best = sorted(np.argsort(-expected, kind="stable")[:2])
    embeddings = embed_tools(model, tokenizer, CATALOGUE)
    assert select_tools(model, tokenizer, QUERY, CATALOGUE, top_k=2, tool_embeddings=embeddings) == \
        [CATALOGUE[i] for i in best]
    caller = NeedleToolCaller(model, tokenizer, top_k_tools=2)
    answer = caller(QUERY, CATALOGUE, max_new_tokens=4, tool_embeddings=embeddings)
    assert answer.tools_offered == [CATALOGUE[i] for i in best]


def test_confidence_matches_the_reference_on_left_padded_turns(model, tokenizer, reference):
    turns = [tokenizer(text).input_ids for text in ("Play Yesterday.", "Set an alarm for 6:45 tomorrow please.")]
    width = max(map(len, turns))
    ids = torch.tensor([[0] * (width - len(t)) + t for t in turns])
    mask = (ids != 0).long()
    found = answer_confidence(model, ids, mask).numpy()
    expected = 1 / (1 + np.exp(-np.asarray([reference[1](t) for t in turns])))
    np.testing.assert_allclose(found, expected, atol=TOLERANCE)


def test_caller_returns_the_confidence_of_the_turn_and_defers_below_the_threshold(model, tokenizer, reference):
    answer = NeedleToolCaller(model, tokenizer, confidence_threshold=0.0)(QUERY, CATALOGUE[:2], max_new_tokens=6)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUERY}], tools=CATALOGUE[:2],
                                           add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    generated = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False)[0, len(prompt_ids):]
    generated = [t for t in generated.tolist() if t not in (0, 1)]
    expected = 1 / (1 + np.exp(-reference[1](prompt_ids + generated)))
    assert answer.confidence == pytest.approx(expected, abs=TOLERANCE)
    assert not answer.deferred
    strict = NeedleToolCaller(model, tokenizer, confidence_threshold=min(1.0, expected + 1e-3))
    assert strict(QUERY, CATALOGUE[:2], max_new_tokens=6).deferred


def test_caller_options_need_their_heads(tokenizer, native):
    config = NeedleConfig.from_needle_config(native)
    bare = NeedleForCausalLM(config)
    with pytest.raises(ValueError, match="contrastive head"):
        NeedleToolCaller(bare, tokenizer, top_k_tools=2)
    with pytest.raises(ValueError, match="confidence head"):
        NeedleToolCaller(bare, tokenizer, confidence_threshold=0.5)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        NeedleToolCaller(NeedleForCausalLM(NeedleConfig.from_needle_config(native, use_confidence_head=True)),
                         tokenizer, confidence_threshold=2)


LONG_TOOL = _tool("long_tool", "word " * 1500, value="string")


@pytest.mark.parametrize("call, problem", [
    (lambda m, t: rank_tools(m, t, QUERY, {"a": CATALOGUE[0]}), r"tools: expected a list of tool schemas, found dict"),
    (lambda m, t: rank_tools(m, t, QUERY, []), r"tools: expected at least one tool schema"),
    (lambda m, t: rank_tools(m, t, QUERY, "tools"), r"tools: expected a list of tool schemas, found str"),
    (lambda m, t: rank_tools(m, t, QUERY, [CATALOGUE[0], "x"]), r"tools\[1\]: expected a tool schema dict, found str"),
    (lambda m, t: rank_tools(m, t, QUERY, [CATALOGUE[0], CATALOGUE[0]]), r"tools\[1\]\.name: 'set_alarm' is also tools\[0\]'s"),
    (lambda m, t: rank_tools(m, t, QUERY, [{"description": "x"}]), r"tools\[0\]\.name: expected a non-empty string"),
    (lambda m, t: rank_tools(m, t, QUERY, [{"type": "function", "function": 3}]), r"tools\[0\]\.function"),
    (lambda m, t: rank_tools(m, t, QUERY, [{"name": "x", "bad": float("nan")}]), r"tools\[0\]: not a JSON schema"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE + [LONG_TOOL]),
     r"tools\[5\]: \d+ tokens, more than the model's max_position_embeddings=512"),
    (lambda m, t: rank_tools(m, t, "word " * 1500, CATALOGUE), r"query: \d+ tokens, more than"),
    (lambda m, t: rank_tools(m, t, 3, CATALOGUE), r"query: expected a string, found int"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, top_k=0), r"top_k: expected a positive int or None, found 0"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, top_k=-2), r"top_k: expected a positive int or None, found -2"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, top_k=True), r"top_k: expected a positive int"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, top_k=1.5), r"top_k: expected a positive int"),
    (lambda m, t: select_tools(m, t, QUERY, CATALOGUE, top_k=None), r"top_k: expected a positive int, found None"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, tool_embeddings=torch.zeros(5, 7)),
     r"tool_embeddings: expected shape \(5, 16\) .*found \(5, 7\)"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, tool_embeddings=torch.zeros(4, 16)),
     r"tool_embeddings: expected shape \(5, 16\)"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, tool_embeddings=torch.full((5, 16), float("nan"))),
     r"tool_embeddings: expected finite values, found NaN or infinity in row 0"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, tool_embeddings=torch.full((5, 16), 0.5)),
     r"tool_embeddings: expected L2-normalised rows \(embed_tools\), found norm 2 in row 0"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, tool_embeddings=torch.zeros(5, 16, dtype=torch.long)),
     r"tool_embeddings: expected a float tensor"),
    (lambda m, t: rank_tools(m, t, QUERY, CATALOGUE, tool_embeddings=[[0.0] * 16] * 5),
     r"tool_embeddings: expected a torch.Tensor"),
    (lambda m, t: embed_tools(m, t, {"a": CATALOGUE[0]}), r"tools: expected a list"),
    (lambda m, t: NeedleToolCaller(m, t, top_k_tools=0), r"top_k_tools: expected a positive int or None, found 0"),
    (lambda m, t: NeedleToolCaller(m, t, confidence_threshold="0.5"), r"confidence_threshold: expected a probability"),
    (lambda m, t: NeedleToolCaller(m, t, confidence_threshold=float("nan")), r"confidence_threshold: expected a probability"),
    (lambda m, t: NeedleToolCaller(m, t, constrained="yes"), r"constrained: expected True or False"),
    (lambda m, t: NeedleToolCaller(m, t)(QUERY, {"a": CATALOGUE[0]}), r"tools: expected a list of tool schemas, found dict"),
    (lambda m, t: NeedleToolCaller(m, t)(QUERY, CATALOGUE, max_new_tokens=0), r"max_new_tokens: expected a positive int"),
    (lambda m, t: NeedleToolCaller(m, t)(None, CATALOGUE), r"query: expected a string"),
    (lambda m, t: NeedleToolCaller(m, t)(QUERY, CATALOGUE + [LONG_TOOL]), r"prompt: \d+ tokens \+ max_new_tokens=64 exceed"),
    (lambda m, t: answer_confidence(m, torch.ones(1, 4)), r"sequences: expected token ids as an integer tensor"),
    (lambda m, t: answer_confidence(m, torch.tensor([[1, 10**6]])), r"sequences: expected ids in \[0, "),
    (lambda m, t: answer_confidence(m, torch.ones(1, 4, dtype=torch.long), torch.ones(1, 3)),
     r"attention_mask: expected shape \(1, 4\)"),
])
def test_bad_routing_inputs_name_the_field_with_expected_and_found(model, tokenizer, call, problem):
    from needle_hf.tools.tool_routing import ToolRoutingError

    with pytest.raises(ToolRoutingError, match=problem):
        call(model, tokenizer)


def test_an_empty_catalogue_is_a_plain_prompt_for_the_caller(model, tokenizer):
    answer = NeedleToolCaller(model, tokenizer, top_k_tools=2)(QUERY, [], max_new_tokens=2)
    assert answer.tools_offered == []
