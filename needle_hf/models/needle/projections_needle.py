"""The projections of PyTorch Needle 2 that write into the residual stream (Flax twin:
`projections_flax_needle`)."""

from __future__ import annotations

from torch import nn


class NeedleResidualLinear(nn.Linear):
    """A projection that writes into the residual stream (attention output, engram value).

    Only its initialisation differs: N(0, 0.02 / sqrt(2 L)) as in the reference, instead of N(0, 0.02).
    """


__all__ = ["NeedleResidualLinear"]
