"""The SDK (`needle_hf.Needle`) and the tool-call grammar on a Needle 3 folder (no reference needed):
a random tiny Needle 3 model with a tokenizer holding the 16 chat markers, its output head narrower
than its vocabulary. The grammar constrains the answers to well-formed tool-call turns, and the
confidence comes from the model's confidence head."""

from __future__ import annotations

import pytest
import torch

from needle_hf.models.needle3 import Needle3Config
from needle_hf.models.needle3.tokenization_needle3 import NEEDLE3_CHAT_MARKERS, build_needle3_tokenizer
from needle_hf.models.needle.tokenization_needle import save_fast_tokenizer
from spm_fixture import train_needle_spm

pytest.importorskip("llguidance")  # the [grammar] extra

VOCAB, OUT_VOCAB = 600, 570
TOOLS = [{"name": "set_alarm", "description": "Set an alarm",
          "parameters": {"type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, one_cpu_thread):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("needle3_sdk")
    spm_path = train_needle_spm(out / "spm", vocab_size=VOCAB, user_defined_symbols=list(NEEDLE3_CHAT_MARKERS))
    torch.manual_seed(0)
    config = Needle3Config(vocab_size=VOCAB, out_vocab=OUT_VOCAB, hidden_size=32, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=2, head_dim=8, value_head_dim=8, sliding_window=0,
                           global_layers=[], engram_layers=[1], engram_slots=31, hyper_connection_lanes=2,
                           max_position_embeddings=512, use_confidence_head=True)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out / "hf")
    save_fast_tokenizer(build_needle3_tokenizer(str(spm_path), model_max_length=512), str(out / "hf"))
    return out / "hf"


def test_sdk_answers_with_well_formed_calls_under_the_grammar(folder):
    from needle_hf import Needle

    agent = Needle(str(folder), tools=TOOLS)
    result = agent.complete("Wake me at 7", max_new_tokens=48)
    answer = result[0] if isinstance(result, list) else result
    assert answer["error_code"] in (None, "truncated")
    if answer["error_code"] is None:  # finished: the grammar admits only a well-formed turn
        assert answer["success"] and answer["type"] in ("call", "respond")
        assert all(call["name"] == "set_alarm" and isinstance(call["arguments"]["hour"], int)
                   for call in answer["function_calls"])
    assert 0.0 <= answer["confidence"] <= 1.0


def test_confidence_is_the_heads_probability_capped_by_token_probabilities(folder):
    from needle_hf.sdk.engine import load_backend

    backend = load_backend(str(folder))
    ids = backend.tokenizer("Wake me at 7")["input_ids"]
    (probability,) = backend.confidence([ids])
    with torch.no_grad():
        expected = torch.sigmoid(backend.model.confidence(torch.tensor([ids]))).item()
    assert abs(probability - expected) <= 1e-6


def test_grammar_masks_fit_the_narrower_output_head(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from needle_hf.generation.grammar import ToolCallGrammar

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    grammar = ToolCallGrammar(tokenizer, vocab_size=model.config.vocab_size)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Wake me at 7"}], tools=TOOLS,
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=40, do_sample=False,
                             logits_processor=[grammar.logits_processor(TOOLS)])
    answer = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert answer and all(token < OUT_VOCAB for token in answer)
    assert answer[0] in (grammar.marker_ids["<tool_call>"], tokenizer.convert_tokens_to_ids("▁"))
