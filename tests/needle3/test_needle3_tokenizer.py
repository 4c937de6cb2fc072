"""The Needle 3 tokenizer (16 chat markers) encodes like the reference's SentencePiece tokenizer, and
its chat template renders the reference's prompt format (`render_example` of cactus-needle 3.2.8)
token for token. The SentencePiece model is trained here with Needle 3's settings."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
from needle.model.finetune import _encode, render_example
from needle.model.tokenizer import BOS_ID, CHAT_MARKERS, PAD_ID, SANTokenizer

from needle3_reference import PLAIN_NATIVE_CONFIG, make_native_params, write_reference_checkpoint
from needle_hf.models.needle3.tokenization_needle3 import NEEDLE3_CHAT_MARKERS, build_needle3_tokenizer
from needle_hf.models.needle.tokenization_needle import TokenizerSourceError
from spm_fixture import FIXTURE_CHAT_MARKERS, fixture_corpus, train_needle_spm
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # Needle 2's chat-template cases
from test_chat_template import CASES  # noqa: E402

VOCAB = 900
TEXTS = [
    *fixture_corpus()[::9],
    "<context>The invoice total is 42 EUR.</context> <extract>total</extract>",
    "<schema>{\"type\": \"object\"}</schema>\nfill it",
    "x<context>y</context>z  and  <extract>",
    "<|im_start|>user\n<tools>[]</tools>\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
    return train_needle_spm(tmp_path_factory.mktemp("n3spm"), vocab_size=VOCAB, user_defined_symbols=list(CHAT_MARKERS))


@pytest.fixture(scope="module")
def fast(spm_path):
    return build_needle3_tokenizer(spm_path)


def test_markers_are_the_references_in_order():
    assert NEEDLE3_CHAT_MARKERS == tuple(CHAT_MARKERS)


def test_markers_are_single_ids_4_to_19(fast):
    assert fast.convert_tokens_to_ids(list(NEEDLE3_CHAT_MARKERS)) == list(range(4, 20))
    ids = [fast("a" + marker, add_special_tokens=False)["input_ids"][-1] for marker in NEEDLE3_CHAT_MARKERS]
    assert ids == list(range(4, 20))


def test_ids_match_sentencepiece(fast, spm_path):
    processor = sentencepiece.SentencePieceProcessor(model_file=spm_path)
    for text in TEXTS:
        ids = fast(text)["input_ids"]
        assert ids == [BOS_ID] + processor.encode(text), text
        assert fast.decode(ids[1:]) == processor.decode(processor.encode(text))


@pytest.mark.parametrize("case", sorted(CASES))
def test_chat_template_gives_the_references_training_ids(case, fast, spm_path):
    example, messages, tools = CASES[case]
    reference = SANTokenizer(spm_path)
    prompt, target = render_example(example)
    length = len(reference.encode(prompt)) + len(reference.encode(target)) + 2
    expected, _ = _encode(reference, example, max_len=length)
    generation = fast.apply_chat_template(messages[:-1], tools=tools, add_generation_prompt=True, tokenize=True)
    assert generation == [BOS_ID] + reference.encode(prompt)  # run.generate's prompt ids
    full = fast.apply_chat_template(messages, tools=tools, tokenize=True)
    assert full == expected


def test_message_text_that_spells_a_needle3_marker_stays_text(fast):
    messages = [{"role": "user", "content": "quote <context> literally"}]
    ids = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert 14 not in ids
    assert "quote <context> literally" in fast.decode(ids)


def test_a_needle2_tokenizer_is_refused(tmp_path):
    path = train_needle_spm(tmp_path, vocab_size=VOCAB, user_defined_symbols=list(FIXTURE_CHAT_MARKERS))
    with pytest.raises(TokenizerSourceError, match="ids 4-19 should be the user-defined Needle 3 chat markers"):
        build_needle3_tokenizer(path)


def test_converted_folder_chats_from_text(tmp_path, spm_path, one_cpu_thread):
    """`needle-hf convert --tokenizer`: the folder's tokenizer and model work together through the Auto classes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from needle_hf.cli import main

    native = {**PLAIN_NATIVE_CONFIG, "vocab_size": VOCAB}
    write_reference_checkpoint(tmp_path / "n3.safetensors", make_native_params(native, seed=1, with_heads=False), native)
    assert main(["convert", str(tmp_path / "n3.safetensors"), str(tmp_path / "hf"), "--tokenizer", spm_path]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Wake me at 7"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    assert inputs["input_ids"][0, 0].item() == BOS_ID and inputs["input_ids"][0, -1].item() != PAD_ID
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        logits = model(out[:, :-1], use_cache=False).logits
    start = inputs["input_ids"].shape[1]
    assert np.array_equal(logits[0, start - 1 :].argmax(-1).numpy(), out[0, start:].numpy())
