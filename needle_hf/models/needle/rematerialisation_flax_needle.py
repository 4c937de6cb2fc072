"""Gradient checkpointing of Flax Needle 2's decoder layers: a layer's backward pass recomputes its
forward from its inputs instead of keeping its activations (`rematerialised`). The PyTorch model
uses transformers' `GradientCheckpointingLayer` instead.
"""

from __future__ import annotations

import jax


def rematerialised(fn, *, activation_argument: int):
    """`fn` whose backward pass recomputes its forward from the inputs instead of keeping activations.

    As `jax.checkpoint`, but the recomputation waits for the output's cotangent: XLA's CPU pipeline
    drops `jax.checkpoint`'s optimisation barriers before it schedules, and with the layers unrolled
    it then recomputes every layer at the start of the backward pass, keeping all the activations
    alive at once. Here the input `args[activation_argument]` (the activations `fn` reads; a float
    array) gets one element of the cotangent times zero added, a data dependency XLA keeps (a
    non-finite cotangent, which spoils the gradients anyway, then spoils all of them).
    """

    @jax.custom_vjp
    def wrapped(*args):
        return fn(*args)

    def forward(*args):
        return fn(*args), args

    def backward(args, cotangent):
        first = jax.tree.leaves(cotangent)[0].reshape(-1)[0]
        args = list(args)
        activations = args[activation_argument]
        args[activation_argument] = activations + (first * 0).astype(activations.dtype)
        return jax.vjp(fn, *args)[1](cotangent)

    wrapped.defvjp(forward, backward)
    return wrapped


__all__ = ["rematerialised"]
