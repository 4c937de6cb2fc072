"""Fine-tuning the Flax Needle model with optax: full or LoRA (a params transform), jit train steps.

The objective is `needle_hf.finetune.trainer.needle_causal_lm_loss` written in JAX: next-token
cross-entropy on the labelled tokens (the assistant target and EOS; labels -100 elsewhere, as made
by `needle_hf.finetune.data`), one token mean over the batch, plus ``mtp_loss_weight`` times the
MTP head's t + 2 cross-entropy.

LoRA is the reference's: for every backbone layer's q, k, v, gate and output projection kernel
W [in, out] (y = x @ W), an adapter A [in, r] ~ N(0, 1) / r and B [r, out] = 0, equal to the
merged kernel W + (alpha / r) * A @ B (`merge_lora`). Training applies it PEFT's way, beside the
frozen kernel, `x @ W + (x @ A) @ ((alpha / r) * B)` (`lora_collection`; the reference merges
before the forward): the same loss, but no merged kernels and no [in, out] kernel gradients, only
A's and B's. The merged params are what `FlaxNeedleForCausalLM.save_pretrained(params=...)` writes.

The optimiser is the reference's: gradient clipping to global norm 1.0, then AdamW with a linear
warm-up over the first 5% of the steps and cosine decay to 0 (`finetune_optimizer`).

    params = model.params
    lora = init_lora(params, rank=8, key=jax.random.PRNGKey(0))
    optimizer = finetune_optimizer(learning_rate=1e-3, total_steps=100)
    step = make_train_step(model, optimizer, lora_scale=16 / 8)
    state = optimizer.init(lora)
    for batch in batches:                         # numpy input_ids / attention_mask / labels [B, T]
        lora, state, loss = step(lora, state, params, batch)
    merged = merge_lora(params, lora, scale=16 / 8)
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from .data import IGNORE_INDEX, checked_option

#: Kernel names (Flax) of the reference's LoRA targets in a backbone layer's self_attn.
LORA_TARGET_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj")


def lora_target_paths(params: dict) -> list[tuple]:
    """Paths ``("model", "layers", i, "self_attn", projection, "kernel")`` of the LoRA targets."""
    return sorted(
        path for path in flatten_dict(params)
        if path[:2] == ("model", "layers") and len(path) == 6 and path[3] == "self_attn"
        and path[4] in LORA_TARGET_PROJECTIONS and path[5] == "kernel"
    )


def init_lora(params: dict, *, rank: int, key: jax.Array) -> dict:
    """The reference's initial adapter {path: {"A" [in, r] ~ N(0, 1) / r, "B" [r, out] = 0}}, float32."""
    rank = checked_option("rank", rank, low=1, integer=True)
    flat = flatten_dict(params)
    adapter = {}
    for path in lora_target_paths(params):
        in_dim, out_dim = flat[path].shape
        key, sub = jax.random.split(key)
        adapter[path] = {"A": jax.random.normal(sub, (in_dim, rank), jnp.float32) / rank,
                         "B": jnp.zeros((rank, out_dim), jnp.float32)}
    return adapter


def merge_lora(params: dict, lora: dict, *, scale: float) -> dict:
    """``params`` with every adapted kernel W replaced by W + scale * A @ B (in W's dtype)."""
    scale = checked_option("scale", scale, low=-math.inf)
    flat = dict(flatten_dict(params))
    for path, adapter in lora.items():
        flat[path] = flat[path] + (scale * adapter["A"] @ adapter["B"]).astype(flat[path].dtype)
    return unflatten_dict(flat)


def lora_collection(lora: dict, *, scale: float) -> dict:
    """The model's `lora` variable collection (`FlaxNeedleForCausalLM.__call__(lora=...)`): each
    adapter {"A", "B": scale * B} at its projection's module path (the kernel path less ``kernel``)."""
    scale = checked_option("scale", scale, low=-math.inf)
    return unflatten_dict({path[:-1]: {"A": adapter["A"], "B": scale * adapter["B"]} for path, adapter in lora.items()})


def _shifted_cross_entropy(logits: jax.Array, labels: jax.Array, shift: int, position_ids=None) -> jax.Array:
    """Token mean of CE(logits[:, t], labels[:, t + shift]) over labelled targets. logits [B, T, V], labels [B, T];
    position_ids [B, T] of a packed batch: a target at position < shift belongs to another sequence."""
    if position_ids is not None:
        labels = jnp.where(position_ids < shift, IGNORE_INDEX, labels)
    targets = labels[:, shift:]
    keep = targets != IGNORE_INDEX
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-shift].astype(jnp.float32),
                                                         jnp.where(keep, targets, 0))
    return jnp.sum(ce * keep) / jnp.maximum(jnp.sum(keep), 1)


def needle_causal_lm_loss(logits, labels, *, mtp_logits=None, mtp_loss_weight: float = 0.0, position_ids=None) -> jax.Array:
    """The Needle fine-tuning loss (see `needle_hf.finetune.trainer.needle_causal_lm_loss`; ``position_ids``
    of a packed batch keep each term inside its sequence)."""
    loss = _shifted_cross_entropy(logits, labels, 1, position_ids)
    if mtp_loss_weight:
        if mtp_logits is None:
            raise ValueError("mtp_loss_weight > 0 needs mtp_logits (call the model with output_mtp_logits=True)")
        loss = loss + mtp_loss_weight * _shifted_cross_entropy(mtp_logits, labels, 2, position_ids)
    return loss


def finetune_optimizer(*, learning_rate: float, total_steps: int, weight_decay: float = 1e-4):
    """The reference's optimiser: clip_by_global_norm(1.0) then AdamW with warm-up (5%) + cosine decay."""
    learning_rate = checked_option("learning_rate", learning_rate, low=0, low_inclusive=False)
    total_steps = checked_option("total_steps", total_steps, low=1, integer=True)
    weight_decay = checked_option("weight_decay", weight_decay, low=0)
    warmup = min(max(1, total_steps // 20), max(total_steps - 1, 1))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup, decay_steps=max(total_steps, 2))
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay))


def make_loss_function(model, *, lora_scale: Optional[float], mtp_loss_weight: float = 0.0) -> Callable:
    """``loss(trainable, frozen_params, batch)``: with ``lora_scale``, ``trainable`` is a LoRA adapter applied
    beside ``frozen_params``; with None, ``trainable`` is the full params tree (``frozen_params`` unused).

    ``batch`` holds ``input_ids``, ``attention_mask`` and ``labels`` [B, T]; a packed (padding-free)
    batch holds ``position_ids`` restarting at 0 per sequence instead of ``attention_mask``.
    """
    if lora_scale is not None:
        lora_scale = checked_option("lora_scale", lora_scale, low=-math.inf)
    mtp_loss_weight = checked_option("mtp_loss_weight", mtp_loss_weight, low=0)

    def loss(trainable, frozen_params, batch):
        if lora_scale is None:
            params, lora = trainable, None
        else:
            params, lora = frozen_params, lora_collection(trainable, scale=lora_scale)
        packed = "attention_mask" not in batch
        outputs = model(batch["input_ids"], attention_mask=batch.get("attention_mask"),
                        position_ids=batch.get("position_ids"), params=params, lora=lora,
                        output_mtp_logits=mtp_loss_weight > 0)
        return needle_causal_lm_loss(outputs.logits, batch["labels"], mtp_logits=outputs.mtp_logits,
                                     mtp_loss_weight=mtp_loss_weight,
                                     position_ids=batch.get("position_ids") if packed else None)

    return loss


def make_train_step(model, optimizer, *, lora_scale: Optional[float], mtp_loss_weight: float = 0.0) -> Callable:
    """A jit-compiled ``step(trainable, opt_state, frozen_params, batch) -> (trainable, opt_state, loss)``."""
    loss_fn = make_loss_function(model, lora_scale=lora_scale, mtp_loss_weight=mtp_loss_weight)

    @jax.jit
    def step(trainable, opt_state, frozen_params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen_params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    return step
