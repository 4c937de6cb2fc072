"""Test support for fine-tuning parity: the reference's LoRA adapter, its loss and gradients, and
the same adapter placed into a PEFT-wrapped PyTorch model.

The reference's loss is its `finetune_local` objective written out with the reference's own pieces
(`merge_lora`, `SimpleAttentionNetwork.apply`, optax's cross-entropy): token mean over the target
and EOS; the MTP term is the same cross-entropy on its t + 2 logits.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from needle_reference import TINY_NATIVE_CONFIG, make_native_params, reference_config
from spm_fixture import FIXTURE_VOCAB_SIZE

# The tiny geometry with the test tokenizer's vocabulary.
FINETUNE_NATIVE_CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE, max_seq_len=512)
# The parity case: LoRA rank and alpha, weight of the MTP term, tolerances.
PARITY_RANK, PARITY_ALPHA, PARITY_MTP_LOSS_WEIGHT = 4, 8.0, 0.5
LOSS_TOLERANCE = 1e-5  # absolute, float32
GRADIENT_TOLERANCE = 1e-4  # relative to the largest gradient of each tensor
# Reference LoRA kernel name -> PyTorch module name in a backbone layer's self_attn.
HF_PROJECTION = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "gate_proj": "gate_proj", "out_proj": "o_proj"}


WEATHER = {"name": "get_weather", "description": "Météo d'une ville — 天气 ☀️",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ALARM = {"name": "set_alarm", "description": "Set an alarm.",
         "parameters": {"type": "object", "properties": {"hour": {"type": "integer"}, "minute": {"type": "integer"},
                                                           "label": {"type": "string"}}}}
EVENT = {"parameters": {"type": "object", "properties": {"when": {"type": "object"}, "who": {"type": "array"}}},
         "name": "create_event", "description": "Shown as <b>title</b> & 'quoted'"}

# Rows of different shapes in one file: Arrow must not merge their keys (nulls would change the text).
EXAMPLES = [
    {"query": "Wake me at 7:30.", "tools": [ALARM], "answers": [{"name": "set_alarm", "arguments": {"hour": 7, "minute": 30}}]},
    {"system": "  Be brief. 🙂 \n", "query": "Météo à São Paulo et 北京?", "tools": [WEATHER, ALARM],
     "reasoning": "\nTwo cities, two calls.  ",
     "answers": [{"name": "get_weather", "arguments": {"city": "São Paulo"}},
                 {"name": "get_weather", "arguments": {"city": "北京"}}]},
    {"query": "What's the meaning of life?", "tools": [WEATHER], "reasoning": "No tool applies.", "answers": []},
    {"query": "Team sync \"Q3\" <ops> & co, all day", "tools": [EVENT],
     "function_calls": [{"name": "create_event", "arguments": {"when": {"start": "2024-07-01", "all_day": True},
                                                               "who": ["Zoë", None, 0.5]}}]},
    {"query": "  alarm   6:05\n\tlabel 'gym'  ", "tools": [ALARM, WEATHER], "system": "Be exact.",
     "answers": [{"name": "set_alarm", "arguments": {"label": "gym", "hour": 6, "minute": 5}}]},
    {"query": "Hello there", "answers": []},
]

@pytest.fixture(scope="module")
def fast_tokenizer(needle_spm_model):
    """The fast Needle tokenizer of the session's SentencePiece model (import into a test module to use)."""
    from needle_hf.models.needle.tokenization_needle import build_fast_tokenizer

    return build_fast_tokenizer(needle_spm_model)


@pytest.fixture(scope="module")
def parity_case(needle_spm_model):
    """`reference_parity_case` of the session's tokenizer."""
    return reference_parity_case(needle_spm_model)


def reference_adapter(params: dict, *, rank: int, seed: int) -> dict:
    """The reference's adapter {path tuple: {"A" [L, in, r], "B" [L, r, out]}} from its `init_lora`,
    with B moved off zero so that every gradient is non-zero."""
    import jax
    from needle.model.finetune import init_lora, lora_target_paths

    lora = init_lora(params, lora_target_paths(params), rank, jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    return {path: {"A": np.asarray(ab["A"]), "B": rng.normal(0, 0.05, np.shape(ab["B"])).astype(np.float32)}
            for path, ab in lora.items()}


def peft_parameter_name(path: tuple, layer: int, matrix: str) -> str:
    """PEFT parameter name of layer ``layer``'s slice of reference adapter ``path``, matrix "A" or "B"."""
    projection = HF_PROJECTION[path[-2]]
    return f"base_model.model.model.layers.{layer}.self_attn.{projection}.lora_{matrix}.default.weight"


def load_adapter_into_peft(peft_model, lora: dict) -> None:
    """Copy a reference adapter into a PEFT model: lora_A.weight = A.T, lora_B.weight = B.T, per layer."""
    import torch

    parameters = dict(peft_model.named_parameters())
    with torch.no_grad():
        for path, ab in lora.items():
            for layer in range(ab["A"].shape[0]):
                parameters[peft_parameter_name(path, layer, "A")].copy_(torch.from_numpy(ab["A"][layer].T.copy()))
                parameters[peft_parameter_name(path, layer, "B")].copy_(torch.from_numpy(ab["B"][layer].T.copy()))


def peft_gradients(peft_model, lora: dict) -> dict:
    """The PEFT model's LoRA gradients in the reference adapter's layout {path: {"A", "B"}}."""
    parameters = dict(peft_model.named_parameters())
    return {path: {matrix: np.stack([parameters[peft_parameter_name(path, layer, matrix)].grad.numpy().T
                                     for layer in range(ab["A"].shape[0])])
                   for matrix in ("A", "B")}
            for path, ab in lora.items()}


def reference_finetune_loss(native: dict, params: dict, lora: dict, *, scale: float, ids, mask, mtp_loss_weight: float):
    """The reference's fine-tuning objective on ``ids`` / ``mask`` [B, T]: (next-token loss, MTP loss,
    gradients {path: {"A", "B"}} of next-token + mtp_loss_weight * MTP)."""
    import jax
    import jax.numpy as jnp
    import optax
    from needle.model.architecture import SimpleAttentionNetwork
    from needle.model.finetune import merge_lora

    model = SimpleAttentionNetwork(reference_config(native))
    ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.float32)

    def shifted(scores, shift):
        ce = optax.softmax_cross_entropy_with_integer_labels(scores[:, :-shift], ids[:, shift:])
        return (ce * mask[:, shift:]).sum() / jnp.maximum(mask[:, shift:].sum(), 1.0)

    def loss_fn(adapter):
        logits, mtp_logits = model.apply({"params": merge_lora(params, adapter, scale)}, ids, return_mtp=True)
        next_token, mtp = shifted(logits, 1), shifted(mtp_logits, 2)
        return next_token + mtp_loss_weight * mtp, (next_token, mtp)

    adapter = jax.tree.map(jnp.asarray, lora)
    (_, (next_token, mtp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(adapter)
    return float(next_token), float(mtp), jax.tree.map(np.asarray, grads)


@functools.lru_cache(maxsize=None)
def reference_parity_case(spm_model_path: str) -> dict:
    """The parity case both frameworks' tests compare with (computed once per session: the reference's
    gradient compiles slowly). EXAMPLES encoded by the reference's `_encode`, PARITY_* adapter settings.

    Returns {"params", "lora", "ids", "mask", "next_token_loss", "mtp_loss", "gradients"}.
    """
    from needle.model.finetune import _encode, render_example
    from needle.model.tokenizer import SANTokenizer

    tokenizer = SANTokenizer(spm_model_path)
    params = make_native_params(FINETUNE_NATIVE_CONFIG, seed=3, with_heads=False)
    lora = reference_adapter(params, rank=PARITY_RANK, seed=5)
    longest = max(len(tokenizer.encode(p)) + len(tokenizer.encode(t)) + 2 for p, t in map(render_example, EXAMPLES))
    encoded = [_encode(tokenizer, example, longest) for example in EXAMPLES]
    ids, mask = np.array([e[0] for e in encoded]), np.array([e[1] for e in encoded], np.float32)
    next_token, mtp, gradients = reference_finetune_loss(
        FINETUNE_NATIVE_CONFIG, params, lora, scale=PARITY_ALPHA / PARITY_RANK, ids=ids, mask=mask,
        mtp_loss_weight=PARITY_MTP_LOSS_WEIGHT)
    return {"params": params, "lora": lora, "ids": ids, "mask": mask, "next_token_loss": next_token,
            "mtp_loss": mtp, "gradients": gradients}


def torch_model_of(params: dict):
    """A float32 `NeedleForCausalLM` of FINETUNE_NATIVE_CONFIG holding reference parameters (strict load)."""
    import torch

    from needle_hf.models.needle.configuration_needle import NeedleConfig
    from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
    from needle_hf.models.needle.weight_names import native_to_hf

    config = NeedleConfig.from_needle_config(FINETUNE_NATIVE_CONFIG)
    model = NeedleForCausalLM._from_config(config, torch_dtype=torch.float32)
    model.load_state_dict({name: torch.from_numpy(value) for name, value in native_to_hf(params, config).items()})
    return model


def peft_model_with_the_parity_adapter(case: dict):
    """`torch_model_of` the parity weights, wrapped by PEFT, holding the parity case's reference adapter."""
    from peft import get_peft_model

    from needle_hf.finetune.trainer import needle_lora_config

    model = get_peft_model(torch_model_of(case["params"]), needle_lora_config(rank=PARITY_RANK, alpha=PARITY_ALPHA))
    load_adapter_into_peft(model, case["lora"])
    return model


def max_relative_difference(ours: dict, reference: dict) -> float:
    """Largest per-tensor max|ours - reference| / max|reference| over an adapter-shaped gradient tree."""
    worst = 0.0
    for path, ab in reference.items():
        for matrix in ("A", "B"):
            expected = np.asarray(ab[matrix])
            worst = max(worst, float(np.abs(np.asarray(ours[path][matrix]) - expected).max() / np.abs(expected).max()))
    return worst
