"""`.cact` v3 against cactus-needle 3.2.8: `needle-hf build` of a converted folder writes the reference
writer's bytes (4-bit CQ, its deployment KV window, the tokenizer record with the 16 chat markers), and
`needle-hf convert` reads a blob the reference wrote into a folder whose logits are the reference's on
the blob's own (dequantised) weights."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from needle3_reference import ALL_OPTIONS_NATIVE_CONFIG, make_native_params, reference_config, reference_logits, write_reference_checkpoint

TOLERANCE = 1e-4
# Every option on, with a vocabulary the fixture corpus can fill.
NATIVE_CONFIG = {**ALL_OPTIONS_NATIVE_CONFIG, "vocab_size": 900, "out_vocab": 880}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_cpu_thread):
    """(folder, params, the reference's .cact with its tokenizer, the SentencePiece model path)."""
    import sentencepiece as spm
    from needle.model.architecture import effective_kv_window
    from needle.model.export import _tokenizer_blob, write_export
    from needle.model.tokenizer import CHAT_MARKERS

    from needle_hf.cli import main
    from spm_fixture import train_needle_spm

    folder = tmp_path_factory.mktemp("needle3_cact")
    params = make_native_params(NATIVE_CONFIG, seed=4)
    write_reference_checkpoint(folder / "model.safetensors", params, NATIVE_CONFIG)
    spm_path = train_needle_spm(folder / "spm", vocab_size=NATIVE_CONFIG["vocab_size"], user_defined_symbols=list(CHAT_MARKERS))
    assert main(["convert", str(folder / "model.safetensors"), str(folder / "hf"), "--tokenizer", str(spm_path)]) == 0
    config = reference_config(NATIVE_CONFIG)
    tokenizer = types.SimpleNamespace(sp=spm.SentencePieceProcessor(model_file=str(spm_path)))
    write_export(params, config, str(folder / "reference.cact"), tokenizer=_tokenizer_blob(tokenizer),
                 kv_window=effective_kv_window(config))
    return folder, params, folder / "reference.cact", spm_path


def test_build_writes_the_reference_writers_bytes(setup):
    from needle_hf.cli import main

    folder, _, reference, spm_path = setup
    assert main(["build", str(folder / "hf"), str(folder / "ours.cact"), "--tokenizer", str(spm_path)]) == 0
    assert (folder / "ours.cact").read_bytes() == reference.read_bytes()


def test_build_refuses_other_widths(setup):
    from needle_hf.conversion.build import build_cact
    from needle_hf.conversion.cact_writer import CactWriteError

    folder, _, _, _ = setup
    with pytest.raises(CactWriteError, match="4-bit"):
        build_cact(folder / "hf", folder / "w2.cact", bits=2)
    assert not (folder / "w2.cact").exists()


def test_read_decodes_what_the_reference_reader_decodes(setup):
    """Every record of the blob, laid out again from our native tree, equals the reference's `read_export` tensor."""
    from needle.model.export import read_export

    from needle_hf.conversion.cact_v3 import _stored, read_cact3, slots

    _, _, reference, _ = setup
    blob = read_cact3(reference)
    header, tensors = read_export(str(reference))
    layout = slots(blob.config, ("embedding", "confidence", "router"))
    assert len(layout) + 1 == header["num_tensors"] and blob.tokenizer == tensors[-1]
    for slot, expected in zip(layout, tensors):
        if slot.name in ("heads.manifest", "router_head.calibration"):
            continue  # written from constants, not from the tree
        found = np.asarray(_stored(slot, blob.flat, blob.config), np.float32).reshape(np.shape(expected))
        assert np.abs(found - expected).max() <= 1e-6, slot.name
    assert blob.kv_window == header["kv_window"]


def test_convert_reads_a_reference_blob(setup, tmp_path):
    """`needle-hf convert` of the reference's .cact: the folder's logits are the reference's forward on
    the blob's dequantised weights, and the heads come back."""
    from transformers import AutoModelForCausalLM

    from needle_hf.cli import main
    from needle_hf.conversion.cact_v3 import read_cact3

    _, _, reference, _ = setup
    assert main(["convert", str(reference), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.config.use_router_head and model.config.use_embedding_head
    nested: dict = {}
    for name, value in read_cact3(reference).flat.items():
        node = nested
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    tokens = np.random.default_rng(5).integers(3, 880, (2, 13))
    expected = reference_logits(NATIVE_CONFIG, nested, tokens)
    with torch.no_grad():
        found = model(torch.from_numpy(tokens), use_cache=False).logits.numpy()
    assert np.abs(found - expected).max() <= TOLERANCE


def test_convert_takes_the_packed_tokenizer(setup, tmp_path):
    """Without --tokenizer, the blob's own piece table becomes the folder's tokenizer: the same ids and
    chat prompts as the tokenizer converted from the SentencePiece model."""
    from transformers import AutoTokenizer

    from needle_hf.cli import main

    folder, _, reference, _ = setup
    assert main(["convert", str(reference), str(tmp_path / "hf")]) == 0
    packed, original = AutoTokenizer.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(folder / "hf")
    messages = [{"role": "user", "content": "Wake me at 7, then call Ana"}]
    tools = [{"name": "set_alarm", "parameters": {"type": "object", "properties": {"hour": {"type": "integer"}}}}]
    prompt = lambda tok: tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)  # noqa: E731
    assert prompt(packed) == prompt(original)
    assert packed("héllo wörld 42")["input_ids"] == original("héllo wörld 42")["input_ids"]


def test_read_refuses_a_truncated_blob(setup, tmp_path):
    from needle_hf.conversion.cact_v3 import Cact3Error, read_cact3

    _, _, reference, _ = setup
    cut = tmp_path / "cut.cact"
    cut.write_bytes(reference.read_bytes()[:-2000])
    with pytest.raises(Cact3Error, match="cut.cact"):
        read_cact3(cut)
