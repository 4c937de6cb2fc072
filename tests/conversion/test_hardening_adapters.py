"""LoRA adapters under hostile input: `needle-hf lora import/export` and `build --lora`.

PEFT adapters saved in bfloat16 or float16 convert like float32 ones. Generated (Hypothesis)
adapter_config.json fields of every type, whole files that are not a JSON object, damaged safetensors
and reference pickles with bad scales or tensors each end with exit status 1 and one error line that
names the file (and the field, for a wrongly typed one), or, where the value is valid, with a correct
result; no command writes NaN or Infinity into a JSON file.
"""

import ast
import json
import math
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from needle_hf.cli import main
from needle_hf.conversion.lora import MAX_SCALE
from needle_hf.conversion.native_checkpoint import safe_unpickle

from test_lora_interop import (  # noqa: F401  (fixtures)
    RANK,
    _reference_adapter,
    _trained_peft_folder,
    hf_dir,
    imported,
    params,
)

REPOSITORY = Path(__file__).resolve().parents[2]
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _one_error(capsys, argv, *fragments) -> str:
    capsys.readouterr()
    status = main([str(part) for part in argv])
    captured = capsys.readouterr()
    command = argv[0]
    lines = [line for line in captured.err.splitlines() if line.startswith(f"needle-hf {command}: error:")]
    assert status == 1 and len(lines) == 1 and "Traceback" not in captured.err, (argv, captured.err)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _strict_json(path: Path):
    return json.loads(path.read_text(encoding="utf-8"), parse_constant=lambda name: pytest.fail(f"{path} holds {name}"))


# ------------------------------------------------------------------------------------------------
# Half-precision PEFT adapters.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_peft_adapter_exports_and_builds(hf_dir, tmp_path, dtype):
    from safetensors.torch import load_file

    model = _trained_peft_folder(hf_dir, tmp_path / "float32")
    model.to(dtype).save_pretrained(str(tmp_path / "half"))
    stored = load_file(str(tmp_path / "half" / "adapter_model.safetensors"))
    assert {value.dtype for value in stored.values()} == {dtype}
    assert main(["lora", "export", str(tmp_path / "half"), str(tmp_path / "half.pkl"), "--base", str(hf_dir)]) == 0
    exported = safe_unpickle(tmp_path / "half.pkl")
    for layer in range(3):
        key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        np.testing.assert_array_equal(exported["lora"]["stack/layers/block/self_attn/q_proj/kernel"]["A"][layer],
                                      stored[f"{key}.lora_A.weight"].float().numpy().T)
    assert main(["build", str(hf_dir), str(tmp_path / "half.cact"), "--lora", str(tmp_path / "half"),
                 "--no-tokenizer"]) == 0


# ------------------------------------------------------------------------------------------------
# adapter_config.json: every field, every JSON type.


@pytest.fixture(scope="module")
def peft_folder(imported):
    folder, _ = imported
    return folder / "peft"


JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 6), st.integers(min_value=2**31, max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.sampled_from(["LORA", "none", "lora_only"]),
    st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)
FIELDS = ("r", "lora_alpha", "peft_type", "bias", "use_dora", "fan_in_fan_out", "use_rslora", "modules_to_save",
          "rank_pattern", "alpha_pattern", "base_model_name_or_path")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _valid(field: str, value, settings: dict, base: str) -> bool:
    """Whether `lora export` (without --base) must accept the adapter with `settings[field] = value`."""
    if field == "r":
        return _is_number(value) and isinstance(value, int) and value == RANK
    if field == "lora_alpha":
        return _is_number(value) and math.isfinite(value) and abs(value / RANK) <= MAX_SCALE
    if field == "peft_type":
        return value == "LORA" and isinstance(value, str)
    if field == "bias":
        return value == "none" and isinstance(value, str)
    if field in ("use_dora", "fan_in_fan_out"):
        return value is None or value is False
    if field == "use_rslora":
        return value is None or isinstance(value, bool)
    if field == "modules_to_save":
        return value is None or value == []
    if field in ("rank_pattern", "alpha_pattern"):
        return value is None or value == {}
    return value == base


@HYPOTHESIS
@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_every_adapter_config_field_is_checked_by_type_and_value(peft_folder, hf_dir, tmp_path_factory, capsys,
                                                                field, value):
    case = tmp_path_factory.mktemp("config")
    folder = Path(shutil.copytree(peft_folder, case / "peft"))
    settings_path = folder / "adapter_config.json"
    settings = json.loads(settings_path.read_text())
    base = str(hf_dir.absolute())
    settings["base_model_name_or_path"] = base
    settings[field] = value
    settings_path.write_text(json.dumps(settings))  # NaN and Infinity as Python's json writes them
    out = case / "out.pkl"
    if _valid(field, value, settings, base):
        assert main(["lora", "export", str(folder), str(out)]) == 0, (field, value)
        assert out.is_file()
        return
    line = _one_error(capsys, ["lora", "export", folder, out], "adapter_config.json")
    if field == "r" and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        assert f"r {value} from adapter_config.json" in line, line  # the tensors' shapes disagree with it
    else:
        assert field in line, line
    assert not out.exists()


@HYPOTHESIS
@given(content=st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"\xff\xfe{}", b'{"r": 4,', b"", b"[" * 100_000 + b"]" * 100_000, b'"LORA"', b"null", b"4"]),
    st.lists(st.integers(), max_size=3).map(lambda value: json.dumps(value).encode()),
))
def test_an_adapter_config_that_is_not_a_json_object_is_named(peft_folder, hf_dir, tmp_path_factory, capsys, content):
    case = tmp_path_factory.mktemp("whole")
    folder = Path(shutil.copytree(peft_folder, case / "peft"))
    (folder / "adapter_config.json").write_bytes(content)
    line = _one_error(capsys, ["lora", "export", folder, case / "out.pkl", "--base", hf_dir], "adapter_config.json")
    assert "expected" in line
    _one_error(capsys, ["lora", "export", folder, case / "out.pkl"], "adapter_config.json")
    assert not (case / "out.pkl").exists()


# ------------------------------------------------------------------------------------------------
# adapter_model.safetensors: damaged files, wrong dtypes, non-finite values.


@HYPOTHESIS
@given(damage=st.sampled_from(["truncate", "garbage", "header"]), position=st.floats(0, 1, exclude_max=True),
       noise=st.binary(min_size=1, max_size=32))
def test_a_damaged_adapter_safetensors_is_named(peft_folder, hf_dir, tmp_path_factory, capsys, damage, position, noise):
    case = tmp_path_factory.mktemp("weights")
    folder = Path(shutil.copytree(peft_folder, case / "peft"))
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    cut = int(position * len(data))
    if damage == "truncate":
        data = data[:cut]
    elif damage == "garbage":
        data = noise
    else:  # bytes overwritten inside the 8-byte length and the JSON header
        header_end = 8 + int.from_bytes(data[:8], "little")
        at = int(position * header_end)
        data = data[:at] + noise + data[at + len(noise):]
        if data == weights.read_bytes():
            return
    weights.write_bytes(data)
    for argv in (["lora", "export", folder, case / "out.pkl", "--base", hf_dir],
                 ["build", hf_dir, case / "out.cact", "--lora", folder, "--no-tokenizer"]):
        capsys.readouterr()
        status = main([str(part) for part in argv])
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
        if status == 0:  # a header byte changed to an equivalent one (e.g. a space): the file still reads
            continue
        lines = [line for line in captured.err.splitlines() if ": error:" in line]
        assert status == 1 and len(lines) == 1 and "adapter_model.safetensors" in lines[0], captured.err
    assert not (case / "out.pkl").exists() or damage == "header"


@pytest.mark.parametrize("problem, message", [
    ("int32", "dtype I32, expected one of F32, F16, BF16"),
    ("nan", "non-finite value"),
    ("inf", "non-finite value"),
    ("empty", "no LoRA tensors"),
])
def test_adapter_tensors_must_be_finite_floats(peft_folder, hf_dir, tmp_path, capsys, problem, message):
    from safetensors.numpy import load_file, save_file

    folder = Path(shutil.copytree(peft_folder, tmp_path / "peft"))
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    if problem == "int32":
        tensors[name] = tensors[name].astype(np.int32)
    elif problem == "empty":
        tensors = {}
    else:
        tensors[name] = tensors[name].copy()
        tensors[name].flat[3] = float(problem)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    _one_error(capsys, ["lora", "export", folder, tmp_path / "out.pkl", "--base", hf_dir], "adapter_model.safetensors",
               message)
    _one_error(capsys, ["build", hf_dir, tmp_path / "out.cact", "--lora", folder], "adapter_model.safetensors", message)


# ------------------------------------------------------------------------------------------------
# The reference's adapter pickle: scales, ranks, tensors.


SCALES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e39, -1e39, 3e38, 0.5]),
                   st.booleans(), st.none(), st.text(max_size=3), st.lists(st.floats(), max_size=1))


@HYPOTHESIS
@given(scale=SCALES)
def test_a_native_adapter_scale_is_finite_and_fits_float32(params, hf_dir, tmp_path_factory, capsys, scale):
    case = tmp_path_factory.mktemp("scale")
    adapter = _reference_adapter(params, kernels=("q_proj",))
    adapter["scale"] = scale
    with open(case / "needle_lora.pkl", "wb") as handle:
        pickle.dump(adapter, handle)
    valid = isinstance(scale, float) and math.isfinite(scale) and abs(scale) <= MAX_SCALE
    argv = ["lora", "import", case / "needle_lora.pkl", case / "peft", "--base", hf_dir]
    if not valid:
        _one_error(capsys, argv, "needle_lora.pkl", "'scale'")
        assert not (case / "peft").exists()
        return
    assert main([str(part) for part in argv]) == 0
    settings = _strict_json(case / "peft" / "adapter_config.json")
    _strict_json(case / "peft" / "needle_adapter.json")
    assert math.isclose(settings["lora_alpha"] / settings["r"], scale, rel_tol=1e-12)
    # A scale the float32 merge cannot hold without overflow is refused at build, naming the kernel.
    product = np.abs(adapter["lora"]["stack/layers/block/self_attn/q_proj/kernel"]["A"]
                     @ adapter["lora"]["stack/layers/block/self_attn/q_proj/kernel"]["B"]).max()
    if abs(scale) * float(product) > 1.001 * float(np.finfo(np.float32).max):
        _one_error(capsys, ["build", hf_dir, case / "out.cact", "--lora", case / "needle_lora.pkl"], "q_proj",
                   "overflows")
        assert not (case / "out.cact").exists()


@pytest.mark.parametrize("change, message", [
    ("rank 0", "rank 0"),
    ("nan A", "non-finite value"),
    ("inf B", "non-finite value"),
    ("rank true", "'rank' is a boolean"),
    ("seed nan", "seed is a number nan"),
    ("qat_bits_map unknown", "unknown name 'attn.o'"),
])
def test_native_adapter_ranks_tensors_and_metadata_are_checked(params, hf_dir, tmp_path, capsys, change, message):
    adapter = _reference_adapter(params, kernels=("q_proj", "v_proj"))
    pair = adapter["lora"]["stack/layers/block/self_attn/q_proj/kernel"]
    if change == "rank 0":
        for entry in adapter["lora"].values():
            entry["A"], entry["B"] = entry["A"][..., :0], entry["B"][:, :0]
        adapter["rank"] = None
    elif change == "nan A":
        pair["A"][1, 2, 0] = np.nan
    elif change == "inf B":
        pair["B"][0, 0, 5] = -np.inf
    elif change == "rank true":
        adapter["rank"] = True
    elif change == "seed nan":
        adapter["seed"] = float("nan")
    else:
        adapter["qat_bits_map"] = "attn.o=2,default=4"
    with open(tmp_path / "needle_lora.pkl", "wb") as handle:
        pickle.dump(adapter, handle)
    _one_error(capsys, ["lora", "import", tmp_path / "needle_lora.pkl", tmp_path / "peft", "--base", hf_dir],
               "needle_lora.pkl", message)
    _one_error(capsys, ["build", hf_dir, tmp_path / "out.cact", "--lora", tmp_path / "needle_lora.pkl"],
               "needle_lora.pkl", message)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["needle_lora.pkl"]


def test_a_recorded_base_that_is_not_a_path_is_named(peft_folder, tmp_path, capsys):
    folder = Path(shutil.copytree(peft_folder, tmp_path / "peft"))
    for value in (None, 4, ["a"], {"x": 1}, "", "no/such/folder", "bad\u0000path"):
        settings = json.loads((folder / "adapter_config.json").read_text())
        settings["base_model_name_or_path"] = value
        (folder / "adapter_config.json").write_text(json.dumps(settings))
        _one_error(capsys, ["lora", "export", folder, tmp_path / "out.pkl"], "adapter_config.json",
                   "base_model_name_or_path", "--base")


# ------------------------------------------------------------------------------------------------
# No JSON file the project writes holds NaN or Infinity.

JSON_WRITERS = sorted([*REPOSITORY.glob("conversion/*.py"), *REPOSITORY.glob("scripts/*.py"),
                       *(REPOSITORY / "needle_hf" / name for name in
                         ("cli.py", "hub/__init__.py", "hub/model_card.py", "models/needle/configuration_needle.py",
                          "models/needle/tokenization_needle.py", "models/needle/remote_code.py", "demo/data.py"))])


@pytest.mark.parametrize("path", JSON_WRITERS, ids=lambda path: str(path.relative_to(REPOSITORY)))
def test_every_json_writer_refuses_nan(path):
    """Every json.dump(s) in a module that writes files passes allow_nan=False."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in ("dump", "dumps") and isinstance(node.func.value, ast.Name)
             and node.func.value.id == "json"]
    for call in calls:
        flags = {keyword.arg: keyword.value for keyword in call.keywords}
        assert "allow_nan" in flags and isinstance(flags["allow_nan"], ast.Constant) and flags["allow_nan"].value is False, \
            f"{path.name}:{call.lineno}: json.{call.func.attr} without allow_nan=False"


def test_a_config_with_a_non_finite_field_is_never_saved(tmp_path):
    from needle_hf import NeedleConfig

    config = NeedleConfig(num_hidden_layers=2, engram_layers=[0])
    config.custom_scale = float("inf")
    with pytest.raises(ValueError, match="field custom_scale holds Infinity"):
        config.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())
