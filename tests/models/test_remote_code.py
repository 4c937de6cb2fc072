"""Remote code: a saved Needle folder loads with `trust_remote_code=True` where needle_hf is not installed.

The loads run in child interpreters with `needle_hf` made unimportable: the main .venv
(transformers 4.57, PyTorch and Flax) and .venv-v5 (transformers 5.x, PyTorch only), each from a
local folder and from a repository on the local hub. Their outputs are compared with the package's
own classes in this process: logits and hidden states to 1e-5, token ids and greedy generations
exactly. The in-process tests check what is shipped: which files, which `auto_map`, and that the
imports of the shipped files are the ones transformers' `check_imports` will accept.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from transformers.dynamic_module_utils import get_imports, get_relative_imports

from hub_support import (
    MAIN_PYTHON,
    TINY_WITH_TOKENIZER,
    V5_PYTHON,
    child_environment,
    finish_python,
    skip_without_flax_model,
    start_python,
    write_child_script,
    write_needle_folder,
)
from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.hub import push_folder
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM, NeedleModel
from needle_hf import remote_code
from needle_hf.models.needle.remote_code import AUTO_MAP, remote_code_files, write_remote_code
from needle_hf.models.needle.tokenization_needle_fast import NeedleTokenizerFast

LOGIT_TOLERANCE = 1e-5
TEXT = "Set an alarm for seven thirty tomorrow morning."
TOOLS = [
    {
        "name": "set_alarm",
        "description": "Set an alarm",
        "parameters": {"type": "object", "properties": {"time": {"type": "string"}}, "required": ["time"]},
    }
]
MESSAGES = [{"role": "user", "content": TEXT}]
NEW_TOKENS = 8
PACKAGE_DIR = Path(remote_code.__file__).resolve().parent

# What each child does for every source (a local folder, then the hub repository). Outputs: token
# ids, class modules and generated text in `out/result.json`; logits as .npy files in `out`.
CHILD_SCRIPT = """
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline

arguments = json.loads(sys.argv[1])
out = Path(arguments["out"])
major = int(transformers.__version__.split(".")[0])
result = {"transformers": transformers.__version__, "sources": {}}
for label, source in arguments["sources"].items():
    entry = result["sources"][label] = {}
    config = AutoConfig.from_pretrained(source, trust_remote_code=True)
    entry["config_class"] = f"{type(config).__module__}.{type(config).__name__}"
    # The tokenizer is transformers' own fast tokenizer: no code of its own to trust.
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True)
    entry["tokenizer_class"] = type(tokenizer).__name__
    entry["tokenizer_module"] = type(tokenizer).__module__
    ids = tokenizer(arguments["text"])["input_ids"]
    entry["input_ids"] = ids

    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True)
    entry["model_class"] = f"{type(model).__module__}.{type(model).__name__}"
    with torch.no_grad():
        np.save(out / f"{label}-torch-logits.npy", model(torch.tensor([ids])).logits.float().numpy())
    # The shipped modeling file uses the attention interface, so transformers lets the kernel be switched.
    entry["attn_before_switch"] = model.config._attn_implementation
    model.set_attn_implementation("eager" if entry["attn_before_switch"] != "eager" else "sdpa")
    entry["attn_after_switch"] = model.config._attn_implementation
    with torch.no_grad():
        np.save(out / f"{label}-switched-logits.npy", model(torch.tensor([ids])).logits.float().numpy())
    backbone = AutoModel.from_pretrained(source, trust_remote_code=True)
    entry["backbone_class"] = f"{type(backbone).__module__}.{type(backbone).__name__}"
    with torch.no_grad():
        np.save(out / f"{label}-torch-hidden.npy", backbone(torch.tensor([ids])).last_hidden_state.float().numpy())

    if arguments["flax"]:
        from transformers import FlaxAutoModelForCausalLM

        flax_model = FlaxAutoModelForCausalLM.from_pretrained(source, trust_remote_code=True)
        entry["flax_model_class"] = f"{type(flax_model).__module__}.{type(flax_model).__name__}"
        np.save(out / f"{label}-flax-logits.npy", np.asarray(flax_model(np.array([ids], dtype=np.int32)).logits))

    generator = pipeline("text-generation", model=source, trust_remote_code=True)
    # transformers 5 takes the tools as a pipeline argument; 4.57 only through the tokenizer kwargs.
    tools = {"tools": arguments["tools"]} if major >= 5 else {"tokenizer_encode_kwargs": {"tools": arguments["tools"]}}
    chat = generator(arguments["messages"], max_new_tokens=arguments["new_tokens"], do_sample=False, **tools)
    entry["pipeline_reply"] = chat[0]["generated_text"][-1]

    if arguments["resave"]:
        # A user who loaded the remote code saves the model again: the new folder must load the same way.
        resaved = out / f"{label}-resaved"
        model.save_pretrained(resaved)
        tokenizer.save_pretrained(resaved)
        entry["resaved_auto_map"] = json.loads((resaved / "config.json").read_text())["auto_map"]
        entry["resaved_files"] = sorted(os.listdir(resaved))
        reloaded = AutoModelForCausalLM.from_pretrained(resaved, trust_remote_code=True)
        with torch.no_grad():
            np.save(out / f"{label}-resaved-logits.npy", reloaded(torch.tensor([ids])).logits.float().numpy())

result["needle_hf_modules"] = sorted(
    name for name, module in sys.modules.items() if name.split(".")[0] == "needle_hf" and module is not None
)
(out / "result.json").write_text(json.dumps(result))
"""

ENVIRONMENTS = {
    "transformers-4.57": dict(python=MAIN_PYTHON, flax=True, major=4),
    "transformers-5": dict(python=V5_PYTHON, flax=False, major=5),
}


class RemoteRun:
    """What one child interpreter reported, with the .npy files it wrote."""

    def __init__(self, report: dict, out: Path):
        self.report, self.out = report, out

    def source(self, label: str) -> dict:
        return self.report["sources"][label]

    def array(self, label: str, name: str) -> np.ndarray:
        return np.load(self.out / f"{label}-{name}.npy")


@pytest.fixture(scope="module")
def remote_folder(tmp_path_factory, needle_spm_model) -> tuple[Path, NeedleConfig]:
    folder = tmp_path_factory.mktemp("remote") / "needle-remote-tiny"
    config = write_needle_folder(folder, TINY_WITH_TOKENIZER, seed=3, spm_model=needle_spm_model)
    return folder, config


@pytest.fixture(scope="module")
def remote_repo_id(remote_folder, local_hub) -> str:
    folder, _ = remote_folder
    repo_id = f"{local_hub.user}/needle-remote-{uuid.uuid4().hex[:8]}"
    push_folder(folder, repo_id)
    return repo_id


@pytest.fixture(scope="module")
def remote_runs(remote_folder, remote_repo_id, tmp_path_factory) -> dict[str, RemoteRun | str | Exception]:
    """Run both children at once (they spend most of their time importing); {environment: run}.

    An environment whose interpreter is missing maps to the reason; a failed child to its error.
    """
    folder, _ = remote_folder
    started = {}
    for name, environment in ENVIRONMENTS.items():
        if not environment["python"].exists():
            started[name] = f"{environment['python']} is missing; run scripts/setup.sh to create it"
            continue
        scratch = tmp_path_factory.mktemp(name)
        script = write_child_script(scratch, "load_remote_code.py", CHILD_SCRIPT)
        arguments = {
            "sources": {"folder": str(folder), "hub": remote_repo_id},
            "out": str(scratch),
            "text": TEXT,
            "tools": TOOLS,
            "messages": MESSAGES,
            "new_tokens": NEW_TOKENS,
            "flax": environment["flax"],
            "resave": True,
        }
        process = start_python(
            environment["python"],
            script,
            arguments,
            environment=child_environment(hf_home=scratch / "hf_home"),
            cwd=scratch,
        )
        started[name] = (process, scratch)
    runs = {}
    for name, entry in started.items():
        if isinstance(entry, str):
            runs[name] = entry
            continue
        process, scratch = entry
        try:
            report = finish_python(process, result_file=scratch / "result.json", timeout=300, what=f"the {name} child")
            runs[name] = RemoteRun(report, scratch)
        except AssertionError as error:
            runs[name] = error
    return runs


def run_for(remote_runs, environment: str) -> RemoteRun:
    run = remote_runs[environment]
    if isinstance(run, str):
        pytest.skip(run)
    if isinstance(run, Exception):
        raise run
    return run


@pytest.fixture(scope="module")
def package_outputs(remote_folder):
    """The package's own classes on the same folder: token ids, logits, hidden states, greedy reply."""
    folder, _ = remote_folder
    tokenizer = NeedleTokenizerFast.from_pretrained(folder)
    ids = tokenizer(TEXT)["input_ids"]
    model = NeedleForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits.numpy()
        hidden = NeedleModel.from_pretrained(folder)(torch.tensor([ids])).last_hidden_state.numpy()
        prompt = tokenizer.apply_chat_template(
            MESSAGES, tools=TOOLS, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        generated = model.generate(
            prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=NEW_TOKENS, do_sample=False
        )
    reply = tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    return dict(ids=ids, logits=logits, hidden=hidden, reply=reply)


@pytest.fixture(scope="module")
def package_flax_logits(remote_folder, package_outputs):
    skip_without_flax_model()
    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    folder, _ = remote_folder
    model = FlaxNeedleForCausalLM.from_pretrained(folder)
    return np.asarray(model(np.array([package_outputs["ids"]], dtype=np.int32)).logits)


SOURCES = ("folder", "hub")


# --------------------------------------------------------------------------------------------------
# What is shipped


def test_write_remote_code_ships_a_file_for_every_auto_class(tmp_path):
    config = NeedleConfig.from_needle_config(TINY_WITH_TOKENIZER)
    written = write_remote_code(tmp_path, config)

    assert config.auto_map == AUTO_MAP
    for auto_class, reference in AUTO_MAP.items():
        module, class_name = reference.split(".")
        source = (tmp_path / f"{module}.py").read_text(encoding="utf-8")
        assert f"\nclass {class_name}(" in source, f"{auto_class}: {module}.py does not define {class_name}"
    # Exactly the package's files, byte for byte: nothing stale, nothing missing.
    assert written == sorted(path.name for path in tmp_path.iterdir())
    for name in written:
        assert (tmp_path / name).read_bytes() == (PACKAGE_DIR / name).read_bytes()


def test_shipped_files_import_only_each_other_and_packages_the_loader_has():
    needed = remote_code_files()
    assert set(needed) == set(AUTO_MAP)
    shipped = {path.name for paths in needed.values() for path in paths}
    for name in shipped:
        relative = {f"{module}.py" for module in get_relative_imports(PACKAGE_DIR / name)}
        assert relative <= shipped, f"{name} imports {relative - shipped}, which would not be shipped"
        assert "needle_hf" not in get_imports(PACKAGE_DIR / name), f"{name} imports the needle_hf package"
    # check_imports looks at the module file of the Auto class being used and its relative imports:
    # the PyTorch classes must not pull in jax/flax (transformers 5 has no Flax).
    for auto_class in ("AutoConfig", "AutoModel", "AutoModelForCausalLM"):
        packages = {package for path in needed[auto_class] for package in get_imports(path)}
        assert not packages & {"jax", "flax", "jaxlib"}, f"{auto_class} would need {packages & {'jax', 'flax'}}"
    flax_packages = {package for path in needed["FlaxAutoModelForCausalLM"] for package in get_imports(path)}
    assert {"jax", "flax"} <= flax_packages


# One module per concept, the same names in both twins: each ships with the model file that uses it.
CONCEPT_MODULES = {
    "AutoModelForCausalLM": ("step_inputs_needle.py", "hyper_connections_needle.py", "engram_needle.py",
                             "mtp_needle.py", "heads_needle.py", "hadamard_mlp_needle.py", "projections_needle.py"),
    "FlaxAutoModelForCausalLM": ("hyper_connections_flax_needle.py", "engram_flax_needle.py", "mtp_flax_needle.py",
                                 "heads_flax_needle.py", "hadamard_mlp_flax_needle.py", "projections_flax_needle.py",
                                 "generation_flax_needle.py", "rematerialisation_flax_needle.py"),
}


@pytest.mark.parametrize("auto_class", sorted(CONCEPT_MODULES))
def test_each_concept_module_ships_with_the_model_file_that_imports_it(auto_class):
    needed = remote_code_files()
    model_file, *reached = needed[auto_class]
    direct = {f"{module}.py" for module in get_relative_imports(model_file)}
    # transformers copies a local folder's remote code one relative import deep from the model file:
    # every file the model's imports reach is imported by the model file itself (but those of the
    # configuration, which AutoConfig's own load fetches).
    beyond = {path.name for path in reached} - {path.name for path in needed["AutoConfig"]} - direct
    assert not beyond, sorted(beyond)
    assert set(CONCEPT_MODULES[auto_class]) <= {path.name for path in reached}


def test_write_remote_code_keeps_foreign_auto_map_entries_and_replaces_needles(tmp_path):
    config = NeedleConfig.from_needle_config(TINY_WITH_TOKENIZER)
    config.auto_map = {"AutoTokenizer": ["tok.Slow", "tok.Fast"], "AutoModel": "old_module.OldModel"}

    write_remote_code(tmp_path, config)

    assert config.auto_map == {"AutoTokenizer": ["tok.Slow", "tok.Fast"], **AUTO_MAP}


def test_pytorch_save_pretrained_writes_the_model_code_and_auto_map(remote_folder, tmp_path):
    folder, _ = remote_folder
    NeedleForCausalLM.from_pretrained(folder).save_pretrained(tmp_path)

    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == AUTO_MAP
    for reference in AUTO_MAP.values():
        assert (tmp_path / f"{reference.split('.')[0]}.py").is_file()


def test_flax_save_pretrained_writes_the_model_code_and_auto_map(remote_folder, tmp_path):
    skip_without_flax_model()
    from needle_hf.models.needle.modeling_flax_needle import FlaxNeedleForCausalLM

    folder, _ = remote_folder
    FlaxNeedleForCausalLM.from_pretrained(folder).save_pretrained(tmp_path)

    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == AUTO_MAP
    for reference in AUTO_MAP.values():
        assert (tmp_path / f"{reference.split('.')[0]}.py").is_file()


# --------------------------------------------------------------------------------------------------
# Loading without needle_hf


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_children_ran_the_expected_transformers_without_needle_hf(remote_runs, environment):
    run = run_for(remote_runs, environment)
    assert int(run.report["transformers"].split(".")[0]) == ENVIRONMENTS[environment]["major"]
    assert run.report["needle_hf_modules"] == []


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_remote_config_and_tokenizer_load_and_encode_like_the_package(
    remote_runs, package_outputs, environment, source
):
    loaded = run_for(remote_runs, environment).source(source)

    assert loaded["config_class"].startswith("transformers_modules.")
    assert loaded["config_class"].endswith(".configuration_needle.NeedleConfig")
    assert loaded["tokenizer_class"] in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert loaded["tokenizer_module"].startswith("transformers.")
    assert loaded["input_ids"] == package_outputs["ids"]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_remote_causal_lm_gives_the_package_logits(remote_runs, package_outputs, environment, source):
    run = run_for(remote_runs, environment)
    loaded = run.source(source)

    assert loaded["model_class"].startswith("transformers_modules.")
    assert loaded["model_class"].endswith(".modeling_needle.NeedleForCausalLM")
    logits = run.array(source, "torch-logits")
    assert logits.shape == package_outputs["logits"].shape
    np.testing.assert_allclose(logits, package_outputs["logits"], atol=LOGIT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_remote_causal_lm_switches_its_attention_kernel(remote_runs, package_outputs, environment, source):
    loaded = run_for(remote_runs, environment).source(source)

    assert {loaded["attn_before_switch"], loaded["attn_after_switch"]} == {"eager", "sdpa"}
    switched = run_for(remote_runs, environment).array(source, "switched-logits")
    np.testing.assert_allclose(switched, package_outputs["logits"], atol=LOGIT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_remote_base_model_gives_the_package_hidden_states(remote_runs, package_outputs, environment, source):
    run = run_for(remote_runs, environment)

    assert run.source(source)["backbone_class"].endswith(".modeling_needle.NeedleModel")
    np.testing.assert_allclose(
        run.array(source, "torch-hidden"), package_outputs["hidden"], atol=LOGIT_TOLERANCE, rtol=0
    )


@pytest.mark.parametrize("source", SOURCES)
def test_remote_flax_causal_lm_gives_the_package_flax_logits(remote_runs, package_flax_logits, source):
    run = run_for(remote_runs, "transformers-4.57")

    assert run.source(source)["flax_model_class"].endswith(".modeling_flax_needle.FlaxNeedleForCausalLM")
    np.testing.assert_allclose(run.array(source, "flax-logits"), package_flax_logits, atol=LOGIT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_remote_pipeline_with_tools_generates_the_package_greedy_reply(
    remote_runs, package_outputs, environment, source
):
    reply = run_for(remote_runs, environment).source(source)["pipeline_reply"]

    assert reply["role"] == "assistant"
    assert package_outputs["reply"]  # the tiny random model still generates NEW_TOKENS tokens of something
    if ENVIRONMENTS[environment]["major"] >= 5:
        # 5.x parses the answer with the folder's response_template: free text (no <think>, no
        # <tool_call>) is the content, stripped, and an empty content is left out.
        assert "<tool_call>" not in package_outputs["reply"] and "<think>" not in package_outputs["reply"]
        assert reply == {"role": "assistant", **({"content": package_outputs["reply"].strip()}
                                                 if package_outputs["reply"].strip() else {})}
    else:
        assert reply["content"] == package_outputs["reply"]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
def test_model_loaded_as_remote_code_saves_a_folder_that_loads_the_same(remote_runs, package_outputs, environment):
    run = run_for(remote_runs, environment)
    loaded = run.source("hub")

    # Every class the re-saved config maps has its code file in the re-saved folder.
    for auto_class, reference in loaded["resaved_auto_map"].items():
        assert f"{reference.split('.')[0]}.py" in loaded["resaved_files"], f"{auto_class}: {reference}"
    assert loaded["resaved_auto_map"]["AutoModelForCausalLM"] == AUTO_MAP["AutoModelForCausalLM"]
    np.testing.assert_allclose(
        run.array("hub", "resaved-logits"), package_outputs["logits"], atol=LOGIT_TOLERANCE, rtol=0
    )
