"""The converted fast tokenizer gives SentencePiece's ids, round-trips, saves and reloads.

Ground truth is `sentencepiece` itself on a Needle-style model trained by the session fixture;
the reference encodes a prompt as `[BOS] + sentencepiece.encode(text)`.
"""

import json
import random

import pytest
import sentencepiece
import transformers
from spm_fixture import FIXTURE_CHAT_MARKERS, FIXTURE_VOCAB_SIZE, fixture_corpus, train_needle_spm

from needle_hf.models.needle.chat_template import TURN_MARKERS

from needle_hf.models.needle.tokenization_needle import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    PieceTable,
    PieceType,
    TokenizerSourceError,
    TokenizerVocabMismatchError,
    build_fast_tokenizer,
    check_vocab_matches,
    save_fast_tokenizer,
)

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

VARIED_TEXTS = {
    "ascii": "Set an alarm for 7:30 tomorrow and text Bob that I'm late.",
    "accents": "Le café est très chaud; Müller fährt über die Brücke, señor.",
    "cjk": "今天天气很好，明日の午前九時に会議、오늘 저녁 일곱 시.",
    "emoji": "Great job 🎉🎉 thumbs 👍🏽 heart ❤️ family 👨‍👩‍👧 flag 🇫🇷",
    "runs_of_spaces": "columns    aligned     with      spaces   ",
    "leading_spaces": "   three leading spaces",
    "single_space": " ",
    "tabs_and_newlines": "a\tb\t\tc\nd\n\n\ne\r\nf \n\t g",
    "digits": "Order 1000017 costs $1234.56 on 2024-12-31 at 23:59, ref #00042, pi 3.14159265358979",
    "code": "def add(a, b):\n    return a + b\n\nfor i in range(10):\n\tprint(i ** 2)  # squares\n",
    "json_with_markers": ('<tool_call>[{"name":"set_alarm","arguments":{"hour":7,"minute":30}},'
                          '{"name":"send_message","arguments":{"recipient":"Chloé","message":"late 🙈"}}]'
                          '</tool_call><|im_end|>'),
    "starts_with_marker": "<|im_start|>user\n<tools>[]</tools>\nhello<|im_end|>\n<|im_start|>assistant\n",
    "marker_after_space": "think first <think>\nreasoning\n</think> then answer",
    "markers_back_to_back": "<tools></tools><tool_result>{\"ok\":true}</tool_result><think></think>",
    "not_in_vocab_bytes": "Snowman ☃, fraktur 𝔘𝔫𝔦, cuneiform 𒀀, box ╬, music 𝄞",
    "private_use_and_controls": "\ue000\x00\x07\u200b\u00a0\ufeff",
    "meta_space_literal": "already▁escaped▁text",
    "marker_lookalikes": "<|im_start |> <tool_call <think >",
    "empty": "",
}


@pytest.fixture(scope="module")
def sentencepiece_model(needle_spm_model):
    return sentencepiece.SentencePieceProcessor(model_file=needle_spm_model)


@pytest.fixture(scope="module")
def fast_tokenizer(needle_spm_model):
    return build_fast_tokenizer(needle_spm_model, model_max_length=2048)


def reference_ids(sentencepiece_model, text):
    return [BOS_ID] + sentencepiece_model.encode(text)


def piece_table_from_processor(processor):
    """The .cact piece table, read through sentencepiece's public API (markers user-defined)."""
    types = []
    for index in range(processor.GetPieceSize()):
        if processor.IsControl(index):
            types.append(PieceType.CONTROL)
        elif processor.IsUnknown(index):
            types.append(PieceType.UNKNOWN)
        elif processor.IsByte(index):
            types.append(PieceType.BYTE)
        elif processor.IdToPiece(index) in FIXTURE_CHAT_MARKERS:
            types.append(PieceType.USER_DEFINED)
        else:
            types.append(PieceType.NORMAL)
    return {
        "pieces": [processor.IdToPiece(index) for index in range(processor.GetPieceSize())],
        "scores": [processor.GetScore(index) for index in range(processor.GetPieceSize())],
        "types": [int(kind) for kind in types],
        "pad_id": processor.pad_id(), "eos_id": processor.eos_id(),
        "bos_id": processor.bos_id(), "unk_id": processor.unk_id(),
        "add_dummy_prefix": True, "byte_fallback": True,
    }


def random_texts(count, seed=0):
    """Seeded mixtures of every character family, markers and whitespace, plus corpus slices."""
    rng = random.Random(seed)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,:;\"'{}[]()<>|_-/\\")
                + list("éèàüößñçøĳ") + list("今天天气很好日本語한국어")
                + ["🎉", "👍🏽", "❤️", "𝔘"]
                + [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u200b", "\u2581"] + list(FIXTURE_CHAT_MARKERS))
    corpus = fixture_corpus()
    texts = []
    while len(texts) < count:
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.3:
            source = rng.choice(corpus)
            start = rng.randrange(len(source))
            text = source[start:start + rng.randint(1, 200)] + text
        # A text that is exactly one marker is the one documented difference (tested below).
        if text not in FIXTURE_CHAT_MARKERS:
            texts.append(text)
    return texts


def test_fixture_model_has_the_needle_layout(sentencepiece_model):
    assert sentencepiece_model.GetPieceSize() == FIXTURE_VOCAB_SIZE
    assert (sentencepiece_model.pad_id(), sentencepiece_model.eos_id(),
            sentencepiece_model.bos_id(), sentencepiece_model.unk_id()) == (PAD_ID, EOS_ID, BOS_ID, UNK_ID)
    assert [sentencepiece_model.IdToPiece(index) for index in range(4, 14)] == list(FIXTURE_CHAT_MARKERS)
    assert sum(sentencepiece_model.IsByte(index) for index in range(FIXTURE_VOCAB_SIZE)) == 256


@pytest.mark.parametrize("name", sorted(VARIED_TEXTS))
def test_ids_match_sentencepiece_on_varied_texts(name, sentencepiece_model, fast_tokenizer):
    text = VARIED_TEXTS[name]
    assert fast_tokenizer(text)["input_ids"] == reference_ids(sentencepiece_model, text)


def test_ids_match_sentencepiece_on_random_texts(sentencepiece_model, fast_tokenizer):
    texts = random_texts(2000)
    batch = fast_tokenizer(texts)["input_ids"]
    mismatched = [text for text, ids in zip(texts, batch) if ids != reference_ids(sentencepiece_model, text)]
    assert mismatched == [], f"{len(mismatched)} of {len(texts)} texts differ, first: {mismatched[:3]!r}"


def test_fixture_corpus_ids_match_sentencepiece(sentencepiece_model, fast_tokenizer):
    corpus = fixture_corpus()
    batch = fast_tokenizer(corpus)["input_ids"]
    assert batch == [reference_ids(sentencepiece_model, text) for text in corpus]


def test_characters_outside_the_vocab_fall_back_to_bytes(sentencepiece_model, fast_tokenizer):
    text = VARIED_TEXTS["not_in_vocab_bytes"]
    ids = fast_tokenizer(text)["input_ids"]
    assert ids == reference_ids(sentencepiece_model, text)
    assert UNK_ID not in ids
    tokens = fast_tokenizer.convert_ids_to_tokens(ids)
    # 𝔘 is F0 9D 94 98 in UTF-8.
    assert ["<0xF0>", "<0x9D>", "<0x94>", "<0x98>"] == tokens[tokens.index("<0xF0>"):tokens.index("<0xF0>") + 4]


def _pieces(tokenizer, sentencepiece_model, text):
    # Pieces by id: tokenizers >= 0.23 names a matched marker by its normalised form (" <|im_start|>").
    return [sentencepiece_model.id_to_piece(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def test_runs_of_spaces_are_kept_and_a_leading_marker_gets_the_dummy_prefix(sentencepiece_model, fast_tokenizer):
    for text in ("a   b", "<|im_start|>user"):
        assert _pieces(fast_tokenizer, sentencepiece_model, text) == sentencepiece_model.encode(text, out_type=str)
    assert _pieces(fast_tokenizer, sentencepiece_model, "a   b").count("\u2581") == 2
    assert _pieces(fast_tokenizer, sentencepiece_model, "<|im_start|>user")[:2] == ["\u2581", "<|im_start|>"]


def test_text_that_is_exactly_one_marker_encodes_as_the_marker_alone(sentencepiece_model, fast_tokenizer):
    # Documented difference: tokenizers normalises a marker's own text with the same normaliser,
    # so a text consisting of one marker and nothing else cannot receive the dummy prefix.
    # SentencePiece emits "▁" first; every longer text matches (see the random-text test).
    for marker_id, marker in enumerate(FIXTURE_CHAT_MARKERS, start=4):
        assert fast_tokenizer(marker)["input_ids"] == [BOS_ID, marker_id]
        space_id = sentencepiece_model.PieceToId("\u2581")
        assert reference_ids(sentencepiece_model, marker) == [BOS_ID, space_id, marker_id]


def _without_bos(ids):
    assert ids[0] == BOS_ID
    return ids[1:]


@pytest.mark.parametrize("name", sorted(VARIED_TEXTS))
def test_decode_inverts_encode_like_sentencepiece(name, sentencepiece_model, fast_tokenizer):
    text = VARIED_TEXTS[name]
    # Every id as written (skip_special_tokens=True also hides the turn markers, tested below).
    decoded = fast_tokenizer.decode(_without_bos(fast_tokenizer(text)["input_ids"]))
    expected = sentencepiece_model.decode(sentencepiece_model.encode(text))
    assert decoded == expected
    if name != "meta_space_literal":  # a literal "▁" decodes to a space in SentencePiece too
        assert decoded == text


def test_random_texts_decode_like_sentencepiece(sentencepiece_model, fast_tokenizer):
    texts = random_texts(500, seed=1)
    decoded = fast_tokenizer.batch_decode([_without_bos(ids) for ids in fast_tokenizer(texts)["input_ids"]])
    assert decoded == [sentencepiece_model.decode(sentencepiece_model.encode(text)) for text in texts]


def test_markers_are_added_tokens_that_decode_as_text(fast_tokenizer):
    assert fast_tokenizer.convert_tokens_to_ids(list(FIXTURE_CHAT_MARKERS)) == list(range(4, 14))
    added = fast_tokenizer.added_tokens_decoder
    # Only the turn markers are flagged special (what hides them in a plain tokenizer under tokenizers 0.22).
    assert all(added[marker_id].content == marker and added[marker_id].special == (marker in TURN_MARKERS)
               for marker_id, marker in enumerate(FIXTURE_CHAT_MARKERS, start=4))
    assert TURN_MARKERS == ("<|im_start|>", "<|im_end|>")
    answer = "<think>\nx\n</think>\n<tool_call>[]</tool_call>"
    ids = fast_tokenizer(answer + "<|im_end|>")["input_ids"] + [EOS_ID]
    # The answer's markers are text; the turn markers delimit turns and skip_special_tokens hides them.
    assert fast_tokenizer.decode(ids, skip_special_tokens=True) == answer
    assert fast_tokenizer.decode(ids[1:-1]) == answer + "<|im_end|>"
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = fast_tokenizer(chat)["input_ids"]
    assert fast_tokenizer.decode(chat_ids, skip_special_tokens=True) == "user\nhi\nassistant\n"
    assert fast_tokenizer.decode(chat_ids[1:]) == chat
    assert fast_tokenizer.batch_decode([chat_ids, ids], skip_special_tokens=True) == ["user\nhi\nassistant\n", answer]
    assert fast_tokenizer.decode(5, skip_special_tokens=True) == ""


def test_special_tokens_are_pad_eos_bos_unk(fast_tokenizer):
    assert (fast_tokenizer.pad_token_id, fast_tokenizer.eos_token_id,
            fast_tokenizer.bos_token_id, fast_tokenizer.unk_token_id) == (PAD_ID, EOS_ID, BOS_ID, UNK_ID)
    assert sorted(fast_tokenizer.all_special_ids) == [PAD_ID, EOS_ID, BOS_ID, UNK_ID]
    assert fast_tokenizer("hi", add_special_tokens=False)["input_ids"][0] != BOS_ID


def test_literal_special_token_text_follows_sentencepiece_when_split(sentencepiece_model, fast_tokenizer):
    text = "<s>strike</s> <pad> <unk> then <tool_call>[]</tool_call>"
    split = fast_tokenizer(text, split_special_tokens=True)["input_ids"]
    assert split == reference_ids(sentencepiece_model, text)
    # Without split_special_tokens the literals are read as the special tokens, as in every
    # transformers SentencePiece tokenizer (chat templates rely on it to write BOS and EOS).
    assert fast_tokenizer(text)["input_ids"][:2] == [BOS_ID, BOS_ID]


def test_a_pair_encodes_as_the_reference_training_sequence(sentencepiece_model, fast_tokenizer):
    prompt = "<|im_start|>user\n<tools>[]</tools>\nhi<|im_end|>\n<|im_start|>assistant\n"
    target = "<tool_call>[]</tool_call><|im_end|>"
    expected = [BOS_ID] + sentencepiece_model.encode(prompt) + sentencepiece_model.encode(target) + [EOS_ID]
    assert fast_tokenizer(prompt, target)["input_ids"] == expected


def test_piece_table_rebuild_gives_the_same_ids(sentencepiece_model, fast_tokenizer):
    rebuilt = build_fast_tokenizer(piece_table_from_processor(sentencepiece_model))
    texts = list(VARIED_TEXTS.values()) + random_texts(300, seed=2)
    assert rebuilt(texts)["input_ids"] == fast_tokenizer(texts)["input_ids"]
    assert rebuilt(texts)["input_ids"] == [reference_ids(sentencepiece_model, text) for text in texts]


def test_reference_cact_tokenizer_blob_rebuilds_the_same_tokenizer(needle_spm_model, sentencepiece_model):
    pytest.importorskip("jax", reason="the reference's export module imports jax")
    from needle.model.export import _tokenizer_blob, parse_tokenizer_blob
    from needle.model.tokenizer import SANTokenizer

    table = parse_tokenizer_blob(_tokenizer_blob(SANTokenizer(needle_spm_model)))
    rebuilt = build_fast_tokenizer(table)
    texts = list(VARIED_TEXTS.values()) + random_texts(300, seed=3)
    assert rebuilt(texts)["input_ids"] == [reference_ids(sentencepiece_model, text) for text in texts]


# Run in a fresh interpreter that never imports needle_hf: what a Hub tool that only tokenizes sees.
_PLAIN_LOAD = r"""
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
texts = json.loads(sys.argv[2])
print(json.dumps({
    "class": type(tokenizer).__name__,
    "needle_hf_imported": any(name.split(".")[0] == "needle_hf" for name in sys.modules),
    "ids": tokenizer(texts)["input_ids"],
    "chat_template": tokenizer.chat_template,
    "specials": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id],
    "prompt": tokenizer.apply_chat_template([{"role": "user", "content": "hi <|im_end|>"}], tokenize=False,
                                            add_generation_prompt=True),
    "hidden": tokenizer.decode(tokenizer("a  b\n<think><|im_end|>")["input_ids"], skip_special_tokens=True),
}))
"""


def _load_without_needle_hf(folder, texts):
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, str(folder), json.dumps(texts)], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_saved_folder_loads_as_a_plain_fast_tokenizer_without_needle_hf(tmp_path, sentencepiece_model, fast_tokenizer):
    save_fast_tokenizer(fast_tokenizer, tmp_path)
    expected_files = ["tokenizer.json", "tokenizer_config.json"]
    if int(transformers.__version__.split(".")[0]) < 5:  # 5.x keeps the special tokens in the config only
        expected_files.append("special_tokens_map.json")
    for name in expected_files:
        assert (tmp_path / name).is_file(), name
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in config
    assert not list(tmp_path.glob("*.py"))  # no code to trust
    assert config["model_max_length"] == 2048

    texts = list(VARIED_TEXTS.values())
    loaded = _load_without_needle_hf(tmp_path, texts)
    assert not loaded["needle_hf_imported"]
    # transformers 5.x's PreTrainedTokenizerFast is an alias of TokenizersBackend, the class it reports.
    assert loaded["class"] in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert loaded["ids"] == [reference_ids(sentencepiece_model, text) for text in texts]
    assert loaded["chat_template"] == fast_tokenizer.chat_template
    assert loaded["specials"] == [BOS_ID, EOS_ID, PAD_ID, UNK_ID]
    assert loaded["prompt"] == fast_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi <|im_end|>"}], tokenize=False, add_generation_prompt=True)
    if transformers.__version__.startswith("4."):
        # tokenizers 0.22: the turn markers' special flag hides them in a plain tokenizer too.
        assert loaded["hidden"] == "a  b\n<think>"
    else:
        # tokenizers 0.23 reads the flag under the normalised spelling (see tokenization_needle_fast):
        # the plain tokenizer keeps the turn marker; the response_template parses answers instead.
        assert loaded["hidden"] == "a  b\n<think><|im_end|>"


def test_needle_tokenizer_class_loads_the_plain_folder_and_hides_the_turn_markers(tmp_path, sentencepiece_model,
                                                                                 fast_tokenizer):
    from transformers import AutoTokenizer

    from needle_hf.models.needle.tokenization_needle_fast import NeedleTokenizerFast

    save_fast_tokenizer(fast_tokenizer, tmp_path)
    reloaded = NeedleTokenizerFast.from_pretrained(tmp_path)
    assert type(reloaded) is NeedleTokenizerFast
    texts = list(VARIED_TEXTS.values())
    assert reloaded(texts)["input_ids"] == [reference_ids(sentencepiece_model, text) for text in texts]
    assert reloaded.chat_template == fast_tokenizer.chat_template
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert reloaded.decode(reloaded("a  b\n<think><|im_end|>")["input_ids"], skip_special_tokens=True) == "a  b\n<think>"
    # With needle_hf imported, AutoTokenizer still honours the folder's class name.
    assert type(AutoTokenizer.from_pretrained(tmp_path)).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")


def test_folders_that_name_the_needle_class_still_load_with_needle_hf(tmp_path, fast_tokenizer):
    from transformers import AutoTokenizer

    from needle_hf.models.needle.tokenization_needle_fast import NeedleTokenizerFast

    save_fast_tokenizer(fast_tokenizer, tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(dict(config, tokenizer_class="NeedleTokenizerFast")))
    assert type(AutoTokenizer.from_pretrained(tmp_path)) is NeedleTokenizerFast


def test_a_folder_with_only_the_sentencepiece_model_loads_through_auto_tokenizer(tmp_path, needle_spm_model,
                                                                                 sentencepiece_model, fast_tokenizer):
    """How the reference ships a tokenizer: a Needle config beside one `tokenizer.model`, no tokenizer.json."""
    import shutil

    from transformers import AutoTokenizer

    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.models.needle.tokenization_needle_fast import NeedleTokenizerFast

    NeedleConfig(vocab_size=FIXTURE_VOCAB_SIZE).save_pretrained(tmp_path)
    shutil.copyfile(needle_spm_model, tmp_path / "tokenizer.model")
    loaded = AutoTokenizer.from_pretrained(tmp_path, model_max_length=2048)
    assert type(loaded) is NeedleTokenizerFast
    texts = list(VARIED_TEXTS.values())
    assert loaded(texts)["input_ids"] == [reference_ids(sentencepiece_model, text) for text in texts]
    messages = [{"role": "user", "content": "lights on, 40%"}]
    assert (loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == fast_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert (loaded.padding_side, loaded.model_max_length, loaded.response_template) == (
        "left", 2048, fast_tokenizer.response_template)
    assert loaded.decode(loaded("a  b\n<think><|im_end|>")["input_ids"], skip_special_tokens=True) == "a  b\n<think>"
    assert not any((tmp_path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))  # nothing written


def test_check_vocab_matches_names_both_sizes(fast_tokenizer):
    check_vocab_matches(fast_tokenizer, FIXTURE_VOCAB_SIZE)
    with pytest.raises(TokenizerVocabMismatchError, match=rf"{FIXTURE_VOCAB_SIZE} ids .* vocab_size 8192"):
        check_vocab_matches(fast_tokenizer, 8192)


def test_piece_table_rejects_a_wrong_layout(sentencepiece_model):
    table = piece_table_from_processor(sentencepiece_model)
    with pytest.raises(TokenizerSourceError, match="missing keys"):
        PieceTable.from_mapping({key: value for key, value in table.items() if key != "scores"})
    pieces = table["pieces"]
    swapped = dict(table, pieces=pieces[:4] + [pieces[5], pieces[4]] + pieces[6:])
    with pytest.raises(TokenizerSourceError, match="chat markers"):
        PieceTable.from_mapping(swapped)
    with pytest.raises(TokenizerSourceError, match="eos_id is 3"):
        PieceTable.from_mapping(dict(table, eos_id=3))
    no_bytes = dict(table, types=[PieceType.NORMAL if kind == PieceType.BYTE else kind for kind in table["types"]])
    with pytest.raises(TokenizerSourceError, match="256 byte pieces are missing"):
        PieceTable.from_mapping(no_bytes)
    with pytest.raises(TokenizerSourceError, match="piece types are 0-4"):
        PieceTable.from_mapping(dict(table, types=table["types"][:-1] + [7]))


def test_vocab_that_would_merge_across_the_prompt_target_boundary_is_refused(sentencepiece_model):
    table = piece_table_from_processor(sentencepiece_model)
    last_normal = max(index for index, kind in enumerate(table["types"]) if kind == PieceType.NORMAL)
    pieces = list(table["pieces"])
    pieces[last_normal] = "\n\u2581"
    with pytest.raises(TokenizerSourceError, match="prompt/target boundary"):
        build_fast_tokenizer(dict(table, pieces=pieces))
    build_fast_tokenizer(dict(table, pieces=pieces), chat_template=None)  # the template is the only concern


@pytest.mark.parametrize("setting, problem", [
    ({"model_type": "unigram"}, "expected a BPE model"),
    ({"remove_extra_whitespaces": True}, "remove_extra_whitespaces=False"),
    ({"normalization_rule_name": "nmt_nfkc"}, "identity normalisation"),
])
def test_sentencepiece_models_with_other_settings_are_refused(tmp_path, setting, problem):
    model_path = train_needle_spm(tmp_path, vocab_size=600, **setting)
    with pytest.raises(TokenizerSourceError, match=problem):
        build_fast_tokenizer(model_path)


def test_unknown_source_type_is_refused():
    with pytest.raises(TypeError, match="expected a SentencePiece .model path"):
        build_fast_tokenizer(8192)


def test_fixture_tokenizer_is_sized_for_the_fixture_vocab(fast_tokenizer):
    assert len(fast_tokenizer) == FIXTURE_VOCAB_SIZE
