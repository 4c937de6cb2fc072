"""LoRA adapters between the reference and PEFT: `needle-hf lora import/export` and `build --lora`.

The reference's side is its own code: adapters pickled as `needle finetune` pickles them, merged
with its `merge_lora`, run with its forward and exported with its `write_export`.
"""

import json
import pickle

import numpy as np
import peft
import pytest
import torch

from needle_hf.cli import main
from needle_hf.conversion.lora import PEFT_TARGET_MODULES, PROJECTIONS
from needle_hf.conversion.native_checkpoint import safe_unpickle
from needle_reference import (
    TINY_NATIVE_CONFIG,
    make_native_params,
    reference_config,
    reference_logits,
    write_native_checkpoint,
)
from spm_fixture import FIXTURE_VOCAB_SIZE

CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE)
RANK, SCALE = 4, 1.75
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def params():
    return make_native_params(CONFIG, seed=21, with_heads=False)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, params, needle_spm_model):
    folder = tmp_path_factory.mktemp("lora_base")
    write_native_checkpoint(folder / "base.pkl", params, CONFIG)
    assert main(["convert", str(folder / "base.pkl"), str(folder / "hf"), "--tokenizer", str(needle_spm_model)]) == 0
    return folder / "hf"


def _reference_adapter(params, kernels=tuple(PROJECTIONS), seed=0) -> dict:
    """An adapter as `needle finetune` pickles it, with B trained away from zero."""
    rng = np.random.default_rng(seed)
    lora = {}
    for name in kernels:
        path = f"stack/layers/block/self_attn/{name}/kernel"
        layers, fan_in, fan_out = params["stack"]["layers"]["block"]["self_attn"][name]["kernel"].shape
        lora[path] = {"A": rng.normal(0, 1, (layers, fan_in, RANK)).astype(np.float32) / RANK,
                      "B": rng.normal(0, 0.05, (layers, RANK, fan_out)).astype(np.float32)}
    return {"lora": lora, "scale": SCALE, "base": "base.pkl", "rank": RANK, "qat_bits": None, "qat_bits_map": None,
            "seed": seed}


def _reference_merge(params, adapter):
    """The reference's `needle build --lora` merge, on its own adapter dict."""
    import jax.numpy as jnp
    from needle.model.finetune import merge_lora

    lora = {tuple(key.split("/")): {"A": jnp.asarray(v["A"]), "B": jnp.asarray(v["B"])} for key, v in adapter["lora"].items()}
    merged = merge_lora(params, lora, adapter["scale"])
    return _as_numpy(merged)


def _as_numpy(tree):
    return {k: _as_numpy(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}


def _hf_model(hf_dir):
    from needle_hf import NeedleForCausalLM

    return NeedleForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()


def _tokens():
    return np.random.default_rng(3).integers(4, FIXTURE_VOCAB_SIZE, (2, 12)).astype(np.int64)


@pytest.fixture(scope="module")
def imported(tmp_path_factory, params, hf_dir):
    folder = tmp_path_factory.mktemp("imported")
    adapter = _reference_adapter(params)
    with open(folder / "needle_lora.pkl", "wb") as handle:
        pickle.dump(adapter, handle)
    assert main(["lora", "import", str(folder / "needle_lora.pkl"), str(folder / "peft"), "--base", str(hf_dir)]) == 0
    return folder, adapter


def test_imported_adapter_loads_in_peft_with_the_reference_merged_logits(imported, params, hf_dir):
    folder, adapter = imported
    model = peft.PeftModel.from_pretrained(_hf_model(hf_dir), str(folder / "peft")).eval()
    adapted = sorted(name for name, module in model.named_modules() if hasattr(module, "lora_A") and "default" in module.lora_A)
    layers = CONFIG["num_layers"]
    assert len(adapted) == 5 * layers and not any(".mtp." in name for name in adapted)
    tokens = _tokens()
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), return_mtp_logits=True)
    want, want_mtp = reference_logits(CONFIG, _reference_merge(params, adapter), tokens)
    assert np.abs(out.logits.numpy() - want).max() <= LOGIT_TOLERANCE
    assert np.abs(out.mtp_logits.numpy() - want_mtp).max() <= LOGIT_TOLERANCE
    # The adapter matters: the base model is far from the merged one.
    base_logits, _ = reference_logits(CONFIG, params, tokens)
    assert np.abs(base_logits - want).max() > 100 * LOGIT_TOLERANCE


def _trained_peft_folder(hf_dir, folder, *, target_modules=PEFT_TARGET_MODULES, **options):
    model = _hf_model(hf_dir)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=target_modules, lora_dropout=0.0, **options)
    model = peft.get_peft_model(model, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(str(folder))
    return model


def test_exported_adapter_merges_in_the_reference_to_peft_merge_and_unload(hf_dir, params, tmp_path):
    from needle_hf.models.needle.weight_names import hf_to_native
    from needle_hf import NeedleConfig

    model = _trained_peft_folder(hf_dir, tmp_path / "peft")
    # No --base: the adapter records its base folder.
    assert main(["lora", "export", str(tmp_path / "peft"), str(tmp_path / "needle_lora.pkl")]) == 0
    with open(tmp_path / "needle_lora.pkl", "rb") as handle:
        adapter = pickle.load(handle)  # as the reference's build_main loads it
    assert adapter["scale"] == 2.0 and adapter["rank"] == RANK
    assert sorted(adapter["lora"]) == sorted(f"stack/layers/block/self_attn/{n}/kernel" for n in PROJECTIONS)
    merged_reference = _reference_merge(params, adapter)
    state = {k: v.numpy() for k, v in model.merge_and_unload().state_dict().items()}
    merged_peft = hf_to_native(state, NeedleConfig.from_pretrained(str(hf_dir)))
    for name in PROJECTIONS:
        got = merged_reference["stack"]["layers"]["block"]["self_attn"][name]["kernel"]
        want = merged_peft["stack"]["layers"]["block"]["self_attn"][name]["kernel"]
        base = params["stack"]["layers"]["block"]["self_attn"][name]["kernel"]
        assert np.abs(got - want).max() <= 1e-6 and np.abs(want - base).max() > 1e-3, name
    # Everything else is untouched, the MTP block included.
    np.testing.assert_array_equal(merged_peft["mtp_block"]["self_attn"]["q_proj"]["kernel"],
                                  params["mtp_block"]["self_attn"]["q_proj"]["kernel"])


def test_import_then_export_returns_the_reference_adapter(imported, hf_dir, tmp_path):
    folder, adapter = imported
    assert main(["lora", "export", str(folder / "peft"), str(tmp_path / "back.pkl"), "--base", str(hf_dir)]) == 0
    back = safe_unpickle(tmp_path / "back.pkl")
    assert back["scale"] == adapter["scale"] and back["rank"] == adapter["rank"]
    for path, pair in adapter["lora"].items():
        np.testing.assert_array_equal(back["lora"][path]["A"], pair["A"])
        np.testing.assert_array_equal(back["lora"][path]["B"], pair["B"])


def test_layers_an_adapter_skips_export_as_zero(hf_dir, params, tmp_path):
    _trained_peft_folder(hf_dir, tmp_path / "peft", target_modules=["q_proj"], layers_to_transform=[1],
                         layers_pattern="layers")
    assert main(["lora", "export", str(tmp_path / "peft"), str(tmp_path / "out.pkl"), "--base", str(hf_dir)]) == 0
    pair = safe_unpickle(tmp_path / "out.pkl")["lora"]["stack/layers/block/self_attn/q_proj/kernel"]
    assert not pair["A"][0].any() and not pair["B"][2].any() and pair["B"][1].any()


def test_build_with_lora_equals_the_reference_build(imported, params, hf_dir, needle_spm_model, tmp_path):
    from needle.model.architecture import effective_kv_window
    from needle.model.export import write_export
    from needle.model.tokenizer import SANTokenizer

    folder, adapter = imported
    assert main(["build", str(hf_dir), str(tmp_path / "ours.cact"), "--lora", str(folder / "peft")]) == 0
    config = reference_config(CONFIG)
    write_export(_reference_merge(params, adapter), config, str(tmp_path / "reference.cact"), bits=4,
                 tokenizer=SANTokenizer(str(needle_spm_model)), kv_window=effective_kv_window(config))
    assert (tmp_path / "ours.cact").read_bytes() == (tmp_path / "reference.cact").read_bytes()
    # The reference's adapter file merges the same way.
    assert main(["build", str(hf_dir), str(tmp_path / "from_pkl.cact"), "--lora", str(folder / "needle_lora.pkl")]) == 0
    assert (tmp_path / "from_pkl.cact").read_bytes() == (tmp_path / "reference.cact").read_bytes()


def test_mtp_block_lora_is_refused_naming_the_tensor(hf_dir, tmp_path, capsys):
    _trained_peft_folder(hf_dir, tmp_path / "peft", target_modules=["q_proj"])  # also matches mtp.block
    assert main(["lora", "export", str(tmp_path / "peft"), str(tmp_path / "out.pkl"), "--base", str(hf_dir)]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "mtp.block.self_attn.q_proj.lora_" in error and "not the MTP block" in error
    assert not (tmp_path / "out.pkl").exists()


def test_unsupported_peft_settings_are_refused(hf_dir, tmp_path, capsys):
    _trained_peft_folder(hf_dir, tmp_path / "peft", bias="lora_only")
    assert main(["lora", "export", str(tmp_path / "peft"), str(tmp_path / "out.pkl"), "--base", str(hf_dir)]) == 1
    assert "bias = 'lora_only'" in capsys.readouterr().err


def test_unsafe_or_malformed_adapter_pickles_are_refused(params, hf_dir, tmp_path, capsys):
    class Exploit:
        def __reduce__(self):
            return (print, ("ran code",))

    bad = tmp_path / "exploit.pkl"
    bad.write_bytes(pickle.dumps({"lora": {}, "scale": Exploit()}))
    assert main(["lora", "import", str(bad), str(tmp_path / "out"), "--base", str(hf_dir)]) == 1
    assert "builtins.print" in capsys.readouterr().err
    adapter = _reference_adapter(params, kernels=("q_proj",))
    adapter["lora"]["stack/layers/block/self_attn/q_proj/kernel"]["A"] = np.zeros((3, 64, RANK + 1), np.float32)
    wrong = tmp_path / "wrong.pkl"
    wrong.write_bytes(pickle.dumps(adapter))
    assert main(["lora", "import", str(wrong), str(tmp_path / "out"), "--base", str(hf_dir)]) == 1
    assert "A (3, 64, 5) and B (3, 4, 64)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "needle2"


def test_qat_scheme_of_the_adapter_is_deployed_and_kept(params, hf_dir, needle_spm_model, tmp_path, capsys):
    from needle.model.architecture import effective_kv_window
    from needle.model.export import write_export
    from needle.model.tokenizer import SANTokenizer

    adapter = dict(_reference_adapter(params, kernels=("q_proj", "out_proj"), seed=4), qat_bits=2)
    (tmp_path / "qat.pkl").write_bytes(pickle.dumps(adapter))
    assert main(["lora", "import", str(tmp_path / "qat.pkl"), str(tmp_path / "peft"), "--base", str(hf_dir)]) == 0
    # Built at the width it was trained for, as the reference's build does it.
    assert main(["build", str(hf_dir), str(tmp_path / "ours.cact"), "--lora", str(tmp_path / "peft")]) == 0
    config = reference_config(CONFIG)
    write_export(_reference_merge(params, adapter), config, str(tmp_path / "reference.cact"), bits=2,
                 tokenizer=SANTokenizer(str(needle_spm_model)), kv_window=effective_kv_window(config))
    assert (tmp_path / "ours.cact").read_bytes() == (tmp_path / "reference.cact").read_bytes()
    assert main(["build", str(hf_dir), str(tmp_path / "w4.cact"), "--lora", str(tmp_path / "peft"), "--bits", "4"]) == 1
    assert "trained (QAT) for CQ W2; --bits 4" in capsys.readouterr().err
    assert not (tmp_path / "w4.cact").exists()
    assert main(["lora", "export", str(tmp_path / "peft"), str(tmp_path / "back.pkl"), "--base", str(hf_dir)]) == 0
    back = safe_unpickle(tmp_path / "back.pkl")
    assert (back["qat_bits"], back["qat_bits_map"], back["seed"]) == (2, None, 4)


def test_reference_build_accepts_the_exported_adapter_and_writes_our_build(hf_dir, needle_spm_model, tmp_path,
                                                                            monkeypatch):
    """`needle build base.pkl --lora exported.pkl` (the reference's own command) == `needle-hf build --lora PEFT_DIR`."""
    import argparse

    from needle.model import finetune
    from needle.model.tokenizer import SANTokenizer

    _trained_peft_folder(hf_dir, tmp_path / "peft")
    assert main(["lora", "export", str(tmp_path / "peft"), str(tmp_path / "needle_lora.pkl")]) == 0
    # The reference fetches its tokenizer from the Hub; hand it the session's model instead.
    monkeypatch.setattr(finetune, "get_tokenizer", lambda vocab_size=None: SANTokenizer(str(needle_spm_model)))
    finetune.build_main(argparse.Namespace(checkpoint=str(hf_dir.parent / "base.pkl"), lora=str(tmp_path / "needle_lora.pkl"),
                                           out=str(tmp_path / "reference.cact"), bits=None, upload=False))
    assert main(["build", str(hf_dir), str(tmp_path / "ours.cact"), "--lora", str(tmp_path / "peft")]) == 0
    assert (tmp_path / "ours.cact").read_bytes() == (tmp_path / "reference.cact").read_bytes()
