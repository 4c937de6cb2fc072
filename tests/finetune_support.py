"""Test support for fine-tuning parity: the reference's LoRA adapter, its loss and gradients, and
the same adapter placed into a PEFT-wrapped PyTorch model.

The reference's loss is its `finetune_local` objective written out with the reference's own pieces
(`merge_lora`, `SimpleAttentionNetwork.apply`, optax's cross-entropy): token mean over the target
and EOS; the MTP term is the same cross-entropy on its t + 2 logits.
"""

from __future__ import annotations

import numpy as np
from needle_reference import TINY_NATIVE_CONFIG, reference_config
from spm_fixture import FIXTURE_VOCAB_SIZE

# The tiny geometry with the test tokenizer's vocabulary.
FINETUNE_NATIVE_CONFIG = dict(TINY_NATIVE_CONFIG, vocab_size=FIXTURE_VOCAB_SIZE, max_seq_len=512)
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


def reference_finetune_loss(native: dict, params: dict, lora: dict, *, scale: float, ids, mask, mtp_loss_weight=0.0):
    """(loss, gradients {path: {"A", "B"}}) of the reference's fine-tuning objective on ``ids`` / ``mask`` [B, T]."""
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
        return shifted(logits, 1) + mtp_loss_weight * shifted(mtp_logits, 2)

    adapter = jax.tree.map(jnp.asarray, lora)
    loss, grads = jax.value_and_grad(loss_fn)(adapter)
    return float(loss), jax.tree.map(np.asarray, grads)


def max_relative_difference(ours: dict, reference: dict) -> float:
    """Largest per-tensor max|ours - reference| / max|reference| over an adapter-shaped gradient tree."""
    worst = 0.0
    for path, ab in reference.items():
        for matrix in ("A", "B"):
            expected = np.asarray(ab[matrix])
            worst = max(worst, float(np.abs(np.asarray(ours[path][matrix]) - expected).max() / np.abs(expected).max()))
    return worst
