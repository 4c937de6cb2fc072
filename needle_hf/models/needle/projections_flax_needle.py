"""The projections of Flax Needle 2: `FlaxNeedleLinear` (a bias-free kernel, with an optional LoRA
adapter beside it) and the decoding kernels (several projections of one input as one matmul,
`fused_projections`, `with_decoding_kernels`). PyTorch twin: `projections_needle`.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.core.frozen_dict import unfreeze

from .configuration_needle import NeedleConfig
from .numerics import FUSED_QKVG_PROJECTIONS
from .ops_flax_needle import normal_initializer


class FlaxNeedleLinear(nn.Module):
    """Bias-free projection `x @ kernel`, kernel [in, out] named like `nn.Dense`'s (`.../kernel`).

    The kernel is declared in `setup`, so a parent can also read it (`.kernel`) and run several
    projections of one input as a single matmul (`fused_projections`). With a LoRA adapter in the
    `lora` collection (`A` [in, r], `B` [r, out], B already scaled by alpha / r), the projection is
    `x @ kernel + (x @ A) @ B`, PEFT's way: equal to the merged kernel's, but no merged kernel is
    formed and the backward pass computes no [in, out] kernel gradient, only A's and B's.
    """

    in_features: int
    out_features: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    def setup(self):
        self.kernel = self.param("kernel", normal_initializer(self.init_std), (self.in_features, self.out_features))

    def has_adapter(self) -> bool:
        """Whether a LoRA adapter is applied beside the kernel."""
        return self.has_variable("lora", "A")

    def __call__(self, x):
        x = x.astype(self.dtype)
        y = x @ self.kernel.astype(self.dtype)  # [..., out]
        if self.has_adapter():
            a, b = self.get_variable("lora", "A"), self.get_variable("lora", "B")
            y = y + (x @ a.astype(self.dtype)) @ b.astype(self.dtype)  # [..., r] @ [r, out]
        return y


# Name of the derived kernel that `with_decoding_kernels` adds beside each layer's attention projections
# (`numerics.FUSED_QKVG_PROJECTIONS`, concatenated in that order).
FUSED_QKVG_KERNEL = "qkvg_kernel"


def with_decoding_kernels(params, config: NeedleConfig) -> dict:
    """``params`` (the causal LM's tree) plus, in each decoder layer's ``self_attn``, the q, k, v and gate
    kernels concatenated into one [D, 2 * A + 2 * K * H] ``qkvg_kernel`` (`FUSED_QKVG_KERNEL`),
    which the attention then reads instead of the four.

    A decoding step reads each kernel once for one row; four separate matrix-vector products read
    them slower than one wider product does on the CPU (benchmarks/README.md). The concatenation is
    a copy of the four kernels, so `generate` makes it once per call, outside its decoding loop;
    other calls see the plain tree.
    """
    params = unfreeze(params)  # a new nested dict (the arrays shared): the caller's tree is left as it is
    for i in range(config.num_hidden_layers):
        attn = params["model"]["layers"][str(i)]["self_attn"]
        attn[FUSED_QKVG_KERNEL] = jnp.concatenate([attn[name]["kernel"] for name in FUSED_QKVG_PROJECTIONS], axis=1)
    return params


def fused_projections(x, projections, *, kernel=None) -> list:
    """[p(x) for p in projections] (FlaxNeedleLinear layers of one input) as a single matmul.

    Worth it for narrow projections: a decoding step reads a few-column kernel inefficiently, and
    one wider matmul reads all of them in one pass. ``kernel``: their kernels already concatenated
    (`with_decoding_kernels`); without it they are concatenated here, a copy, which inside a decoding
    loop (generate's `while_loop`) XLA hoists out of the loop.
    """
    if kernel is None:
        kernel = jnp.concatenate([p.kernel for p in projections], axis=1)
    out = x.astype(projections[0].dtype) @ kernel.astype(projections[0].dtype)
    return jnp.split(out, np.cumsum([p.out_features for p in projections])[:-1].tolist(), axis=-1)


__all__ = ["FUSED_QKVG_KERNEL", "FlaxNeedleLinear", "fused_projections", "with_decoding_kernels"]
