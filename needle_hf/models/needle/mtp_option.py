"""The `generate` option that turns on Needle's MTP self-speculation: ``use_mtp_head=True``.

Shared by the PyTorch and Flax `generate` (`speculative.py`, `speculative_flax.py`). The option is
read from the `generate` call or from the generation config (`GenerationConfig(use_mtp_head=True)`
keeps unknown fields as attributes on 4.57 and 5.x).

It is not called ``use_mtp``: transformers 5.14+ has its own `GenerationConfig.use_mtp` (DeepSeek-style
MTP layers, run as assisted generation through `MTPCandidateGenerator`), which knows nothing of
Needle's head. On transformers 4.x ``use_mtp`` is still accepted as a deprecated alias; on 5.x a true
``use_mtp`` (argument or generation config) is refused with an error, so transformers' own MTP path
never runs on a Needle model.
"""

from __future__ import annotations

import warnings

import transformers

#: Needle's option: draft token t+2 with the model's MTP head, verify with the backbone.
MTP_OPTION = "use_mtp_head"
#: The former spelling; transformers 5.14+ owns it.
LEGACY_MTP_OPTION = "use_mtp"
TRANSFORMERS_OWNS_USE_MTP = int(transformers.__version__.split(".")[0]) >= 5


def _checked(name: str, value):
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}: expected True, False or None, found {value!r}")
    return value


def pop_mtp_option(kwargs: dict, generation_config) -> bool:
    """Whether a `generate` call asks for MTP self-speculation; takes the option out of ``kwargs``.

    Args:
        kwargs: the call's keyword arguments (``use_mtp_head`` is removed; so is ``use_mtp`` on 4.x).
        generation_config: the call's generation config, or the model's when the call gives none.

    Raises:
        ValueError: on transformers 5.x, a true ``use_mtp`` (transformers' own MTP, not Needle's).
    """
    requested = _checked(MTP_OPTION, kwargs.pop(MTP_OPTION, None))
    if requested is None:
        requested = _checked(MTP_OPTION, getattr(generation_config, MTP_OPTION, None))
    if TRANSFORMERS_OWNS_USE_MTP:
        legacy = kwargs.get(LEGACY_MTP_OPTION)
        if legacy is None:
            legacy = getattr(generation_config, LEGACY_MTP_OPTION, None)
        if legacy:
            raise ValueError(
                f"generate({LEGACY_MTP_OPTION}=True) is transformers' own multi-token prediction (DeepSeek-style "
                f"MTP layers), which Needle does not have; Needle's MTP head drafts with {MTP_OPTION}=True")
        return bool(requested)
    legacy = _checked(LEGACY_MTP_OPTION, kwargs.pop(LEGACY_MTP_OPTION, None))
    if legacy is None:
        legacy = _checked(LEGACY_MTP_OPTION, getattr(generation_config, LEGACY_MTP_OPTION, None))
    if legacy is not None:
        warnings.warn(f"{LEGACY_MTP_OPTION} is deprecated (transformers 5 gives the name another meaning): "
                      f"use {MTP_OPTION}", FutureWarning, stacklevel=3)
        if requested is None:
            requested = legacy
    return bool(requested)
