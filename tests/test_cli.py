"""The `needle-hf` command line: the installed console script, and a clear error, a non-zero exit
status and nothing left on disk for every kind of bad input.

Bad inputs go through `needle_hf.cli.main` in-process; the console script itself runs once.
"""

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from needle_hf.cli import main
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config, write_native_checkpoint
from spm_fixture import FIXTURE_VOCAB_SIZE

CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE)


@pytest.fixture(scope="module")
def params():
    return make_native_params(CONFIG, seed=5, with_heads=False)


@pytest.fixture(scope="module")
def checkpoint(params, tmp_path_factory):
    path = tmp_path_factory.mktemp("source") / "needle2-tiny.pkl"
    write_native_checkpoint(path, params, CONFIG)
    return path


@pytest.fixture(scope="module")
def blob(params, needle_spm_model, tmp_path_factory):
    from needle.model.export import write_export
    from needle.model.tokenizer import SANTokenizer

    path = tmp_path_factory.mktemp("blob") / "needle2-tiny.cact"
    write_export(params, reference_config(CONFIG), str(path), bits=4, tokenizer=SANTokenizer(str(needle_spm_model)))
    return path


@pytest.fixture(scope="module")
def hf_folder(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "needle2-hf"
    assert main(["convert", str(checkpoint), str(out)]) == 0
    return out


def _listing(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def _fails(capsys, argv, *messages, command="convert"):
    """Run the CLI, expect exit status 1 and every message fragment in its one error line."""
    capsys.readouterr()
    assert main([command, *map(str, argv)]) == 1
    captured = capsys.readouterr()
    error = [line for line in captured.err.splitlines() if line.startswith(f"needle-hf {command}: error:")]
    assert len(error) == 1, captured.err
    for message in messages:
        assert message in error[0], error[0]
    assert captured.out == ""
    return error[0]


def _write_pickle(path: Path, payload, protocol=4):
    with open(path, "wb") as handle:
        pickle.dump(payload, handle, protocol=protocol)
    return path


def _with_leaf(params, path, value):
    tree = {key: dict(node) if isinstance(node, dict) else node for key, node in params.items()}
    node = tree
    for key in path[:-1]:
        node[key] = dict(node[key]) if key in node else {}
        node = node[key]
    node[path[-1]] = value
    return tree


# ------------------------------------------------------------------------------------------------
# The installed command.


def test_console_script_converts_and_prints_progress_and_a_summary(checkpoint, tmp_path):
    script = Path(sys.executable).parent / "needle-hf"
    out = tmp_path / "needle2-hf"
    run = subprocess.run([str(script), "convert", str(checkpoint), str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = run.stdout.strip().splitlines()
    assert len(summary) == 1
    assert f"wrote {out}: 96 tensors, " in summary[0] and " bytes (float32), " in summary[0]
    assert "logits not verified" in summary[0]
    progress = [line for line in run.stderr.splitlines() if line.startswith("needle-hf convert [")]
    assert any("reading" in line for line in progress) and any("writing 96 tensors" in line for line in progress)
    assert any("no tokenizer" in line for line in progress)
    assert (out / "model.safetensors").is_file() and (out / "conversion_report.json").is_file()


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "convert" in capsys.readouterr().out


def test_usage_errors_exit_with_status_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "only-one-argument"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["convert", "a.pkl", "out", "--dtype", "int8"])


# ------------------------------------------------------------------------------------------------
# Bad sources.


class _RunsCode:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def test_malicious_pickle_is_refused_and_never_runs(capsys, params, tmp_path):
    sentinel = tmp_path / "pwned"
    source = _write_pickle(tmp_path / "model.pkl", {"format_version": 2, "params": params, "config": _RunsCode(sentinel)})
    _fails(capsys, [source, tmp_path / "out"], "system", "refusing to load it")
    assert not sentinel.exists()
    assert _listing(tmp_path) == ["model.pkl"]


def test_wrong_format_version(capsys, params, tmp_path):
    source = _write_pickle(tmp_path / "model.pkl", {"format_version": 1, "params": params, "config": CONFIG})
    _fails(capsys, [source, tmp_path / "out"], "format_version 1 found, expected 2")
    assert _listing(tmp_path) == ["model.pkl"]


def test_truncated_cact(capsys, blob, tmp_path):
    data = blob.read_bytes()
    source = tmp_path / "model.cact"
    source.write_bytes(data[: len(data) // 2])
    _fails(capsys, [source, tmp_path / "out"], "model.cact", "lie past the end")
    assert _listing(tmp_path) == ["model.cact"]


def test_bad_cact_tag(capsys, blob, tmp_path):
    source = tmp_path / "model.cact"
    source.write_bytes(struct.pack("<I", 0xDEADBEEF) + blob.read_bytes()[4:])
    _fails(capsys, [source, tmp_path / "out"], "not a .cact blob: tag 0xDEADBEEF, expected 0x05E12A83")
    assert _listing(tmp_path) == ["model.cact"]


def test_unrecognised_content(capsys, tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    _fails(capsys, [source, tmp_path / "out"], "unrecognised content", "expected a native checkpoint")


def test_hf_folder_as_source_is_refused(capsys, hf_folder, tmp_path):
    _fails(capsys, [hf_folder / "model.safetensors", tmp_path / "out"], "already in Hugging Face layout")
    assert _listing(tmp_path) == []


def test_missing_source(capsys, tmp_path):
    _fails(capsys, [tmp_path / "nowhere.pkl", tmp_path / "out"], "no source file at")


def test_unknown_key(capsys, params, tmp_path):
    extra = _with_leaf(params, ("stack", "bogus_gate"), np.zeros((3,), np.float32))
    source = tmp_path / "model.pkl"
    write_native_checkpoint(source, extra, CONFIG)
    _fails(capsys, [source, tmp_path / "out"], "unexpected tensor stack/bogus_gate")
    assert _listing(tmp_path) == ["model.pkl"]


def test_missing_key(capsys, params, tmp_path):
    missing = {key: value for key, value in params.items() if key != "engrams_1"}
    source = tmp_path / "model.pkl"
    write_native_checkpoint(source, missing, CONFIG)
    _fails(capsys, [source, tmp_path / "out"], "missing tensor engrams_1/embedding (for model.engrams.1.tables)")


def test_shape_mismatch(capsys, params, tmp_path):
    wrong = _with_leaf(params, ("stack", "final_norm", "scale"), np.zeros((65,), np.float32))
    source = tmp_path / "model.pkl"
    write_native_checkpoint(source, wrong, CONFIG)
    _fails(capsys, [source, tmp_path / "out"], "stack/final_norm/scale", "expected shape (64,), got (65,)")


def test_float16_overflow_names_the_tensor(capsys, params, tmp_path):
    huge = _with_leaf(params, ("stack", "final_norm", "scale"), np.full((64,), 1e6, np.float32))
    source = tmp_path / "model.pkl"
    write_native_checkpoint(source, huge, CONFIG)
    _fails(capsys, [source, tmp_path / "out", "--dtype", "float16"], "model.norm.weight", "overflow float16")
    assert _listing(tmp_path) == ["model.pkl"]


# ------------------------------------------------------------------------------------------------
# Bad tokenizers.


def test_vocab_size_mismatch(capsys, needle_spm_model, tmp_path):
    small = dict(TINY_NATIVE_CONFIG)  # vocab 512, the tokenizer has 800
    source = tmp_path / "model.pkl"
    write_native_checkpoint(source, make_native_params(small, seed=1, with_heads=False), small)
    _fails(capsys, [source, tmp_path / "out", "--tokenizer", needle_spm_model],
           "tokenizer has 800 ids but the model (model.pkl) has vocab_size 512")
    assert _listing(tmp_path) == ["model.pkl"]


def test_tokenizer_that_is_not_a_sentencepiece_model(capsys, checkpoint, tmp_path):
    not_a_model = tmp_path / "tokenizer.model"
    not_a_model.write_bytes(b"\xff\xfe definitely not a protobuf \x00\x01")
    _fails(capsys, [checkpoint, tmp_path / "out", "--tokenizer", not_a_model], "not a SentencePiece model file")
    assert _listing(tmp_path) == ["tokenizer.model"]


# ------------------------------------------------------------------------------------------------
# The output folder.


def test_existing_non_empty_output_without_overwrite(capsys, checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _fails(capsys, [checkpoint, out], "exists and is not empty; pass --overwrite")
    assert _listing(tmp_path) == ["out", "out/keep.txt"]


def test_overwrite_replaces_the_folder_and_an_empty_one_is_used(checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["convert", str(checkpoint), str(out)]) == 0  # empty: no --overwrite needed
    (out / "stale.txt").write_text("old")
    assert main(["convert", str(checkpoint), str(out), "--overwrite"]) == 0
    assert "out/stale.txt" not in _listing(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging or previous folder left over


def test_missing_parent_folder(capsys, checkpoint, tmp_path):
    _fails(capsys, [checkpoint, tmp_path / "no" / "such" / "out"], "does not exist; create it first")
    assert _listing(tmp_path) == []


def test_failed_verification_leaves_the_old_folder_and_no_staging(capsys, checkpoint, tmp_path, monkeypatch):
    """A late failure (after the files are written) removes the staging folder; --overwrite keeps the old one."""
    from needle_hf.conversion import verification

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    real_model_logits = verification.model_logits

    def off_by_a_bit(*args, **kwargs):
        logits, mtp = real_model_logits(*args, **kwargs)
        return logits + 0.01, mtp

    monkeypatch.setattr(verification, "model_logits", off_by_a_bit)
    _fails(capsys, [checkpoint, out, "--overwrite", "--verify-with", "torch"],
           "verification failed: max abs logit diff", "does not reproduce needle2-tiny.pkl")
    assert _listing(tmp_path) == ["out", "out/keep.txt"]


# ------------------------------------------------------------------------------------------------
# export.


def test_export_unknown_tensor(capsys, hf_folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes((hf_folder / "config.json").read_bytes())
    tensors = load_file(str(hf_folder / "model.safetensors"))
    tensors["model.layers.1.self_attn.bias"] = np.zeros((64,), np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _fails(capsys, [folder, tmp_path / "out.pkl"], "unexpected tensor model.layers.1.self_attn.bias", command="export")
    assert _listing(tmp_path) == ["hf", "hf/config.json", "hf/model.safetensors"]


def test_export_missing_tensor_and_wrong_shape(capsys, hf_folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes((hf_folder / "config.json").read_bytes())
    tensors = load_file(str(hf_folder / "model.safetensors"))
    del tensors["mtp.norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _fails(capsys, [folder, tmp_path / "out.pkl"], "missing tensor mtp.norm.weight", "use_mtp_head", command="export")
    tensors["mtp.norm.weight"] = np.zeros((32,), np.float32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _fails(capsys, [folder, tmp_path / "out.pkl"], "tensor mtp.norm.weight: expected shape (64,), got (32,)", command="export")
    assert not (tmp_path / "out.pkl").exists()


def test_export_refuses_other_models_and_existing_output(capsys, hf_folder, tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    _fails(capsys, [folder, tmp_path / "out.pkl"], "model_type 'llama', expected 'needle2'", command="export")
    existing = tmp_path / "existing.pkl"
    existing.write_bytes(b"precious")
    _fails(capsys, [hf_folder, existing], "exists; pass --overwrite", command="export")
    assert existing.read_bytes() == b"precious"
    assert main(["export", str(hf_folder), str(existing), "--overwrite"]) == 0
    assert existing.read_bytes()[:2] == b"\x80\x04"  # a pickle now
    assert sorted(os.listdir(tmp_path)) == ["existing.pkl", "llama"]  # no staging file left over


def test_the_command_line_imports_no_model_code():
    """`needle-hf convert` needs neither framework's model code: importing the package registers
    deferred stand-ins with the Auto classes, which resolve to the real classes on first use."""
    script = (
        "import sys\n"
        "import needle_hf.cli\n"
        "loaded = sorted(m for m in ('jax', 'flax', 'needle_hf.models.needle.modeling_needle', 'needle_hf.models.needle.modeling_flax_needle') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "from transformers import AutoModelForCausalLM, FlaxAutoModelForCausalLM\n"
        "from needle_hf.models.needle.configuration_needle import NeedleConfig\n"
        "from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM\n"
        "from needle_hf.models.needle.modeling_needle import NeedleForCausalLM\n"
        "config = NeedleConfig(num_hidden_layers=2, engram_layers=[1], hidden_size=64, attention_dim=64, num_attention_heads=2,\n"
        "                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=32)\n"
        "assert type(AutoModelForCausalLM.from_config(config)) is NeedleForCausalLM\n"
        "assert FlaxAutoModelForCausalLM.from_config(config).__class__ is FlaxNeedleForCausalLM\n"
        "import needle_hf\n"
        "assert needle_hf.NeedleForCausalLM is NeedleForCausalLM\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
