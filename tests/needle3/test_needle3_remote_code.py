"""Remote code: a saved Needle 3 folder loads with `trust_remote_code=True` where needle_hf is not importable.

The loads run in child interpreters with `needle_hf` blocked: this environment's (transformers 4.57:
the PyTorch and the Flax twin) and .venv-v5's (transformers 5.x, PyTorch), each with an empty module
cache and no PYTHONPATH. Their logits, confidence logits and greedy tokens are compared with the
package's own model in this process. The in-process tests check what is shipped: the files, flat,
and the `auto_map`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from needle_hf.models.needle3 import Needle3Config
from needle_hf.models.needle3.remote_code_needle3 import AUTO_MAP, RemoteCodeError, flat_source, remote_code_files

REPO_ROOT = Path(__file__).resolve().parents[2]
V5_PYTHON = REPO_ROOT / ".venv-v5" / "bin" / "python"
LOGIT_TOLERANCE = 1e-5
SHIPPED = [
    "config_fields.py", "configuration_needle3.py", "modeling_flax_needle3.py", "modeling_needle3.py", "norms_flax_needle.py",
    "norms_needle.py", "numerics.py", "remote_code_needle3.py", "specification_needle.py", "weight_names.py",
    "weight_names_needle3.py",
]
CONFIG = dict(
    vocab_size=120, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, head_dim=6,
    value_head_dim=10, sliding_window=3, global_layers=[1], qkv_conv_taps=3, engram_orders=[2, 3], engram_heads=2,
    engram_seed_heads=3, engram_slots=53, engram_layers=[0, 2], hyper_connection_lanes=3, out_vocab=100,
    use_confidence_head=True,
)
IDS = [[2, 17, 4, 99, 31, 8, 60, 7]]
NEW_TOKENS = 6

CHILD = """
import sys
sys.modules["needle_hf"] = None  # not importable: whatever loads came from the folder's code
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

folder, out = sys.argv[1], Path(sys.argv[2])
ids = torch.tensor(json.loads(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
result = {"transformers": transformers.__version__, "module": type(model).__module__}
with torch.no_grad():
    np.save(out / "logits.npy", model(ids).logits.numpy())
    np.save(out / "confidence.npy", model.confidence(ids).numpy())
    result["greedy"] = model.generate(ids, max_new_tokens=%(new)d, do_sample=False)[0, ids.shape[1]:].tolist()
if hasattr(transformers, "FlaxAutoModelForCausalLM"):
    flax_model = transformers.FlaxAutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    result["flax_module"] = type(flax_model).__module__
    np.save(out / "flax_logits.npy", np.asarray(flax_model(ids.numpy()).logits))
    sequences = flax_model.generate(ids.numpy(), max_new_tokens=%(new)d, do_sample=False).sequences
    result["flax_greedy"] = np.asarray(sequences)[0, ids.shape[1]:].tolist()
(out / "result.json").write_text(json.dumps(result))
""" % {"new": NEW_TOKENS}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, one_cpu_thread):
    """(model, folder): a `Needle3ForCausalLM` with every parameter perturbed, saved by `save_pretrained`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(Needle3Config(**CONFIG)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.add_(torch.randn_like(parameter) * (0.05 if "embed" in name or "tables" in name else 0.2))
    folder = tmp_path_factory.mktemp("needle3_remote")
    model.save_pretrained(folder)
    return model, folder


def run_child(python, folder: Path, tmp_path: Path) -> tuple[dict, Path]:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD), encoding="utf-8")
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([str(python), str(script), str(folder), str(out), json.dumps(IDS)], cwd=str(tmp_path),
                          env=environment, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((out / "result.json").read_text()), out


def _expected(model):
    ids = torch.tensor(IDS)
    with torch.no_grad():
        return (model(ids).logits.numpy(), model.confidence(ids).numpy(),
                model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist())


def test_saved_folder_ships_flat_code_and_auto_map(saved):
    _, folder = saved
    assert sorted(path.name for path in folder.glob("*.py")) == SHIPPED
    assert json.loads((folder / "config.json").read_text())["auto_map"] == AUTO_MAP
    for path in folder.glob("*.py"):
        assert not re.search(r"^\s*from\s+\.\.", path.read_text(encoding="utf-8"), flags=re.MULTILINE), path.name


def test_flat_source_refuses_an_import_it_cannot_ship(tmp_path):
    path = tmp_path / "module.py"
    path.write_text("from ...elsewhere import thing\n", encoding="utf-8")
    with pytest.raises(RemoteCodeError, match="module.py"):
        flat_source(path)


def test_remote_code_files_leave_out_entries_whose_files_are_missing(saved, tmp_path):
    """A copy holding only the PyTorch model's files maps AutoConfig and the PyTorch classes, not the Flax ones."""
    _, folder = saved
    for name in SHIPPED:
        if name not in ("modeling_flax_needle3.py", "weight_names.py", "weight_names_needle3.py"):
            (tmp_path / name).write_text((folder / name).read_text(encoding="utf-8"), encoding="utf-8")
    assert sorted(remote_code_files(tmp_path)) == ["AutoConfig", "AutoModel", "AutoModelForCausalLM"]


def test_loads_without_needle_hf_under_transformers_4(saved, tmp_path):
    """This environment's transformers (4.57 with jax/flax where the Flax twin is tested)."""
    model, folder = saved
    result, out = run_child(sys.executable, folder, tmp_path)
    logits, confidence, greedy = _expected(model)
    assert result["module"].startswith("transformers_modules.")
    assert np.abs(np.load(out / "logits.npy") - logits).max() <= LOGIT_TOLERANCE
    assert np.abs(np.load(out / "confidence.npy") - confidence).max() <= LOGIT_TOLERANCE
    assert result["greedy"] == greedy
    if "flax_module" in result:
        assert result["flax_module"].startswith("transformers_modules.")
        assert np.abs(np.load(out / "flax_logits.npy") - logits).max() <= 1e-4
        assert result["flax_greedy"] == greedy


@pytest.mark.skipif(not V5_PYTHON.is_file(), reason=".venv-v5 (transformers 5.x) is not set up")
def test_loads_without_needle_hf_under_transformers_5(saved, tmp_path):
    model, folder = saved
    result, out = run_child(V5_PYTHON, folder, tmp_path)
    logits, confidence, greedy = _expected(model)
    assert result["transformers"].startswith("5.")
    assert np.abs(np.load(out / "logits.npy") - logits).max() <= LOGIT_TOLERANCE
    assert np.abs(np.load(out / "confidence.npy") - confidence).max() <= LOGIT_TOLERANCE
    assert result["greedy"] == greedy
