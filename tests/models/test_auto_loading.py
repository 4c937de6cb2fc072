"""Every way a user loads a Needle folder through the Auto classes, with every dtype spelling.

The README's loading snippets go through `AutoConfig`, `AutoTokenizer`, `AutoModel`,
`AutoModelForCausalLM`, `FlaxAutoModel` and `FlaxAutoModelForCausalLM`; users pass the dtype as
`dtype=` (Flax), `torch_dtype=` or `dtype=` (PyTorch, transformers 4.57 and 5.x) or `"auto"`. Each
combination is loaded from a saved folder and from a repository on the local test hub, in four child
interpreters: transformers 4.57 and 5.x, each once with needle_hf imported (the package's classes)
and once with needle_hf unimportable (`trust_remote_code=True`, the folder's own code). Every load
reports its class, its compute dtype and its logits, compared here with the package's float32 model:
float32 loads to 1e-5, bfloat16 loads by the greedy token (bf16 is not reproducible even inside the
reference).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hub_support import (
    MAIN_PYTHON,
    REPO_ROOT,
    TINY_WITH_TOKENIZER,
    V5_PYTHON,
    child_environment,
    finish_python,
    start_python,
    write_needle_folder,
)
from needle_hf.hub import push_folder
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM, NeedleModel

TEXT = "Turn the living room lights off at nine."
FLOAT32_TOLERANCE = 1e-5
# bf16 logits of a tiny random model: the greedy token of a position can flip where the float32 top
# two are within bf16's rounding; positions whose float32 margin exceeds this are compared.
BF16_DECISIVE_MARGIN = 0.05

# (loader keyword, spelling) pairs; the spelling is evaluated in the child (`torch.bfloat16`, ...).
TORCH_DTYPES = {
    "default": None,
    "torch_dtype=torch.float32": ("torch_dtype", "torch.float32"),
    "torch_dtype=torch.bfloat16": ("torch_dtype", "torch.bfloat16"),
    "torch_dtype='bfloat16'": ("torch_dtype", "'bfloat16'"),
    "dtype=torch.float32": ("dtype", "torch.float32"),
    "dtype=torch.bfloat16": ("dtype", "torch.bfloat16"),
    "dtype='auto'": ("dtype", "'auto'"),
    "torch_dtype='auto'": ("torch_dtype", "'auto'"),
}
FLAX_DTYPES = {
    "default": None,
    "dtype=jnp.float32": ("dtype", "jnp.float32"),
    "dtype=jnp.bfloat16": ("dtype", "jnp.bfloat16"),
    "dtype='bfloat16'": ("dtype", "'bfloat16'"),
    "dtype='auto'": ("dtype", "'auto'"),
}
EXPECTED_DTYPE = {"default": "float32", "auto": "stored"}

CHILD_SCRIPT = """
import json
import sys
from pathlib import Path

import numpy as np

arguments = json.loads(sys.argv[1])
if arguments["package"]:
    sys.modules.pop("needle_hf", None)  # unblock: load through the package's own classes
    sys.path.insert(0, arguments["repo_root"])
    import needle_hf  # noqa: F401
else:
    sys.modules["needle_hf"] = None  # only the folder's shipped code can load the model

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

remote = {} if arguments["package"] else {"trust_remote_code": True}
out = Path(arguments["out"])
result = {"transformers": transformers.__version__, "loads": []}


def keywords(spelling):
    if spelling is None:
        return {}
    key, value = spelling
    return {key: eval(value, {"torch": torch, "jnp": globals().get("jnp")})}


for label, source in arguments["sources"].items():
    config = AutoConfig.from_pretrained(source, **remote)
    tokenizer = AutoTokenizer.from_pretrained(source, **remote)
    ids = tokenizer(arguments["text"])["input_ids"]
    result["loads"].append(dict(source=label, auto="AutoConfig", cls=type(config).__name__))
    result["loads"].append(dict(source=label, auto="AutoTokenizer", cls=type(tokenizer).__name__, ids=ids))
    for auto in (AutoModelForCausalLM, AutoModel):
        for name, spelling in arguments["torch_dtypes"].items():
            model = auto.from_pretrained(source, **remote, **keywords(spelling))
            with torch.no_grad():
                output = model(torch.tensor([ids]))
            values = output.logits if auto is AutoModelForCausalLM else output.last_hidden_state
            key = f"{label}-{auto.__name__}-{len(result['loads'])}"
            np.save(out / f"{key}.npy", values.float().numpy())
            result["loads"].append(dict(
                source=label, auto=auto.__name__, spelling=name, cls=type(model).__name__,
                dtype=str(next(model.parameters()).dtype).removeprefix("torch."), array=key,
            ))
    if arguments["flax"]:
        import jax.numpy as jnp
        from transformers import FlaxAutoModel, FlaxAutoModelForCausalLM

        for auto in (FlaxAutoModelForCausalLM, FlaxAutoModel):
            for name, spelling in arguments["flax_dtypes"].items():
                model = auto.from_pretrained(source, **remote, **keywords(spelling))
                output = model(np.array([ids], dtype=np.int32))
                values = output.logits if auto is FlaxAutoModelForCausalLM else output.last_hidden_state
                key = f"{label}-{auto.__name__}-{len(result['loads'])}"
                np.save(out / f"{key}.npy", np.asarray(values, dtype=np.float32))
                result["loads"].append(dict(
                    source=label, auto=auto.__name__, spelling=name, cls=type(model).__name__,
                    dtype=jnp.dtype(model.dtype).name, array=key,
                ))
(out / "result.json").write_text(json.dumps(result))
"""

CHILDREN = {
    "4.57-package": dict(python=MAIN_PYTHON, flax=True, package=True),
    "4.57-remote-code": dict(python=MAIN_PYTHON, flax=True, package=False),
    "5.x-package": dict(python=V5_PYTHON, flax=False, package=True),
    "5.x-remote-code": dict(python=V5_PYTHON, flax=False, package=False),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, needle_spm_model) -> dict[str, Path]:
    """A float32 folder, and the same weights saved in bfloat16 (what `"auto"` must pick up)."""
    root = tmp_path_factory.mktemp("auto-loading")
    float32 = root / "needle-f32"
    write_needle_folder(float32, TINY_WITH_TOKENIZER, seed=11, spm_model=needle_spm_model)
    bfloat16 = root / "needle-bf16"
    NeedleForCausalLM.from_pretrained(float32, dtype=torch.bfloat16).save_pretrained(bfloat16)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(float32).save_pretrained(bfloat16)
    return {"f32": float32, "bf16": bfloat16}


@pytest.fixture(scope="module")
def hub_repos(folders, local_hub) -> dict[str, str]:
    repos = {}
    for label, folder in folders.items():
        repos[label] = f"{local_hub.user}/needle-auto-{label}-{uuid.uuid4().hex[:8]}"
        push_folder(folder, repos[label])
    return repos


@pytest.fixture(scope="module")
def expected(folders) -> dict:
    """The package's own float32 outputs: token ids, logits, hidden states."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folders["f32"])(TEXT)["input_ids"]
    with torch.no_grad():
        logits = NeedleForCausalLM.from_pretrained(folders["f32"])(torch.tensor([ids])).logits.numpy()
        hidden = NeedleModel.from_pretrained(folders["f32"])(torch.tensor([ids])).last_hidden_state.numpy()
    return dict(ids=ids, logits=logits, hidden=hidden)


@pytest.fixture(scope="module")
def children(folders, hub_repos, tmp_path_factory) -> dict:
    """Start all four children at once (they spend most of their time importing); {name: (report, out)}."""
    started = {}
    for name, child in CHILDREN.items():
        if not child["python"].exists():
            started[name] = f"{child['python']} is missing; run scripts/setup.sh to create it"
            continue
        out = tmp_path_factory.mktemp(name)
        script = out / "load_every_way.py"
        script.write_text(CHILD_SCRIPT, encoding="utf-8")
        arguments = {
            "sources": {
                "folder-f32": str(folders["f32"]), "hub-f32": hub_repos["f32"],
                "folder-bf16": str(folders["bf16"]), "hub-bf16": hub_repos["bf16"],
            },
            "out": str(out), "text": TEXT, "repo_root": str(REPO_ROOT), "package": child["package"],
            "flax": child["flax"], "torch_dtypes": TORCH_DTYPES, "flax_dtypes": FLAX_DTYPES,
        }
        process = start_python(
            child["python"], script, arguments, environment=child_environment(hf_home=out / "hf_home"), cwd=out
        )
        started[name] = (process, out)
    reports = {}
    for name, entry in started.items():
        if isinstance(entry, str):
            reports[name] = entry
            continue
        process, out = entry
        try:
            reports[name] = (finish_python(process, result_file=out / "result.json", timeout=600, what=name), out)
        except AssertionError as error:
            reports[name] = error
    return reports


def _report(children, name):
    report = children[name]
    if isinstance(report, str):
        pytest.skip(report)
    if isinstance(report, Exception):
        raise report
    return report


def _expected_dtype(spelling: str, source: str, *, transformers_major: int, flax: bool) -> str:
    """What a load should compute in: `"auto"` is the stored dtype; so is the PyTorch default from
    transformers 5 on (its `from_pretrained` defaults to `dtype="auto"`); 4.57 and Flax default to float32."""
    if "auto" in spelling or (spelling == "default" and transformers_major >= 5 and not flax):
        return "bfloat16" if source.endswith("bf16") else "float32"
    if spelling == "default":
        return "float32"
    return "bfloat16" if "bfloat16" in spelling else "float32"


@pytest.mark.parametrize("child", list(CHILDREN))
def test_every_auto_class_loads_with_every_dtype_spelling(children, expected, child):
    report, out = _report(children, child)
    loads = report["loads"]
    model_loads = [load for load in loads if "spelling" in load]
    sources = {load["source"] for load in loads}
    assert sources == {"folder-f32", "hub-f32", "folder-bf16", "hub-bf16"}
    flax = CHILDREN[child]["flax"]
    per_source = len(TORCH_DTYPES) * 2 + (len(FLAX_DTYPES) * 2 if flax else 0)
    assert len(model_loads) == per_source * len(sources)

    for load in loads:
        if load["auto"] == "AutoConfig":
            assert load["cls"] == "NeedleConfig"
        elif load["auto"] == "AutoTokenizer":
            assert load["ids"] == expected["ids"], f"{child} {load['source']}: token ids differ"
    for load in model_loads:
        where = f"{child} {load['source']} {load['auto']}({load['spelling']})"
        want_dtype = _expected_dtype(
            load["spelling"], load["source"], transformers_major=int(report["transformers"].split(".")[0]),
            flax=load["auto"].startswith("Flax"),
        )
        assert load["dtype"] == want_dtype, f"{where}: compute dtype {load['dtype']}, expected {want_dtype}"
        causal = "ForCausalLM" in load["auto"]
        assert load["cls"].endswith("NeedleForCausalLM" if causal else "NeedleModel"), where
        values = np.load(Path(out) / f"{load['array']}.npy")
        reference = expected["logits"] if causal else expected["hidden"]
        assert values.shape == reference.shape, where
        stored_bf16 = load["source"].endswith("bf16")
        if want_dtype == "float32" and not stored_bf16:
            np.testing.assert_allclose(values, reference, atol=FLOAT32_TOLERANCE, rtol=0, err_msg=where)
        elif causal:
            top2 = np.sort(reference[0], axis=-1)[:, -2:]
            decisive = (top2[:, 1] - top2[:, 0]) > BF16_DECISIVE_MARGIN
            assert decisive.any(), "no position with a clear greedy token: pick another seed"
            np.testing.assert_array_equal(
                values[0].argmax(-1)[decisive], reference[0].argmax(-1)[decisive], err_msg=where
            )
        else:
            np.testing.assert_allclose(values, reference, atol=0.1, rtol=0.05, err_msg=where)


def test_an_unsupported_flax_dtype_names_the_argument(folders):
    pytest.importorskip("flax")
    from hub_support import skip_without_flax_model

    skip_without_flax_model()
    import jax.numpy as jnp
    from transformers import FlaxAutoModelForCausalLM

    with pytest.raises(ValueError, match=r"dtype: expected one of float32, bfloat16, float16.*int32"):
        FlaxAutoModelForCausalLM.from_pretrained(folders["f32"], dtype=jnp.int32)
