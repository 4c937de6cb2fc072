"""Strict loading of PyTorch Needle 2 checkpoints: every tensor the config names, no other, each of
its shape, and the tied output head equal to the token embedding (`NeedleWeightsError` otherwise).

Once transformers has built the model (its config says which tensors to expect), the checkpoint's
``model.safetensors`` is checked, before transformers' loading report is read, by the checker the
Flax model uses (`weight_names.check_weights`), so both twins word a damaged file alike; the
loading report (`raise_unless_exact`) covers what that file check cannot see (other formats,
shards, a tied head transformers unties).
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.utils import cached_file

from .numerics import TIED_WEIGHTS
from .specification_needle import NeedleWeightsError
from .weight_names import HEAD_PREFIXES, check_tied_values, check_weights, hf_weight_shapes, without_tied_aliases

SAFE_WEIGHTS_NAME = "model.safetensors"
# `from_pretrained` options that say where the files are (`transformers.utils.cached_file`).
_HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies",
                "_commit_hash")
# Options that load from somewhere else than the folder's model.safetensors.
_OTHER_SOURCES = ("state_dict", "gguf_file", "from_tf", "from_flax")


def _local_checkpoint_tensor(source, name: str, *, shape_only: bool = False):
    """Tensor ``name`` (or its shape) in the safetensors files of a local folder (None when not found there)."""
    if not os.path.isdir(str(source)):
        return None
    for file_name in sorted(os.listdir(source)):
        if file_name.endswith(".safetensors"):
            with safe_open(os.path.join(source, file_name), framework="pt") as handle:
                if name in handle.keys():
                    return tuple(handle.get_slice(name).get_shape()) if shape_only else handle.get_tensor(name)
    return None


def _untied_names(model: PreTrainedModel, source) -> list[str]:
    """Tied names (`TIED_WEIGHTS`) whose checkpoint tensor differs from its source: 5.x then unties
    them; 4.57 keeps the tie and drops the checkpoint's tensor, read back here from a local folder."""
    untied = []
    for tied, source_name in TIED_WEIGHTS.items():
        try:
            tied_param, source_param = model.get_parameter(tied), model.get_parameter(source_name)
        except AttributeError:  # the bare backbone has no output head
            continue
        stored = _local_checkpoint_tensor(source, tied) if tied_param is source_param else None
        if tied_param is not source_param or (stored is not None and not torch.equal(stored.to(source_param), source_param)):
            untied.append(tied)
    return untied


def raise_unless_exact(model: PreTrainedModel, loading_info: dict, source, unused_prefixes: tuple = ()) -> None:
    # A tied name is never required (its source is, and is reported when missing).
    missing = sorted(name for name in loading_info.get("missing_keys") or [] if name not in TIED_WEIGHTS)
    untied = _untied_names(model, source)
    unused_prefixes = tuple(getattr(model, "_unused_checkpoint_prefixes", ())) + tuple(unused_prefixes)
    unexpected = sorted(
        name for name in loading_info.get("unexpected_keys") or [] if not name.startswith(unused_prefixes)
    )
    expected_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    mismatched = []
    for entry in loading_info.get("mismatched_keys") or []:
        # transformers 5.x reports (name, checkpoint shape, model shape); 4.57 reports the name only.
        if isinstance(entry, (tuple, list)):
            name, found = entry[0], tuple(entry[1])
        else:
            name, found = entry, _local_checkpoint_tensor(source, entry, shape_only=True)
        mismatched.append(f"{name}: expected {expected_shapes.get(name)}, got {found or 'a different shape'}")
    if not (missing or unexpected or mismatched or untied):
        return

    def listing(names):
        shown = ", ".join(names[:5])
        return shown + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")

    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {listing(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) of the wrong shape: {listing(sorted(mismatched))}")
    for name in untied:
        problems.append(f"{name} differs from {TIED_WEIGHTS[name]} (the output head is tied to the token embedding)")
    hint = ""
    if any(name.startswith(("mtp.", "contrastive_head.", "confidence_head.")) for name in missing + unexpected):
        hint = (
            " The optional heads present must agree with use_mtp_head / use_contrastive_head /"
            " use_confidence_head in config.json (a backbone checkpoint loads with `without_heads=True`)."
        )
    raise NeedleWeightsError(
        f"{type(model).__name__}.from_pretrained({str(source)!r}): the checkpoint does not match the config: "
        + "; ".join(problems)
        + "."
        + hint
    )


def fill_tied_alias(module, state_dict, prefix, *args):
    """`load_state_dict` pre-hook: a state dict of the weight table (no ``lm_head.weight``) loads
    strictly, since the tied head is the embedding; an alias that differs from it is refused."""
    for tied, source in TIED_WEIGHTS.items():
        tied, source = prefix + tied, prefix + source
        if source not in state_dict:
            continue  # reported as missing by the load itself
        if tied not in state_dict:
            state_dict[tied] = state_dict[source]
        elif not torch.equal(state_dict[tied], state_dict[source]):
            raise NeedleWeightsError(
                f"state dict: {tied} differs from {source}; Needle's output head is tied to the token embedding"
            )


def check_checkpoint_file(model: PreTrainedModel, source, options: dict, *, without_heads: bool = False) -> None:
    """Check ``source``'s ``model.safetensors`` against the table for ``model.config`` with the checker
    of both twins (`check_weights`, `check_tied_values`); nothing to check when the folder has no such
    file (shards, other formats) or the weights come from elsewhere (``options``).

    Names are the causal LM's (a bare backbone's file names its tensors without ``model.``); the
    backbone reads the ``model.`` ones and leaves the heads, as ``without_heads`` does.
    """
    if any(options.get(name) for name in _OTHER_SOURCES):
        return
    hub_options = {name: options[name] for name in _HUB_OPTIONS if name in options}
    weights = cached_file(source, SAFE_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False,
                          _raise_exceptions_for_connection_errors=False, **hub_options)
    if weights is None:
        return
    with safe_open(weights, framework="pt") as handle:
        stored = set(handle.keys())
        if stored & TIED_WEIGHTS.keys():
            pairs = [name for name in (*TIED_WEIGHTS, *TIED_WEIGHTS.values()) if name in stored]
            check_tied_values({name: handle.get_tensor(name).float().numpy() for name in pairs}, where=weights)
        found = without_tied_aliases({name: tuple(handle.get_slice(name).get_shape()) for name in stored})
    if not any(name.startswith("model.") for name in found):  # a bare backbone's file: names under `model.`
        found = {f"model.{name}": shape for name, shape in found.items()}
    backbone = not hasattr(model, "lm_head")
    expected = hf_weight_shapes(model.config, prefix="model." if backbone else "")
    ignored = HEAD_PREFIXES if backbone or without_heads else ()
    check_weights(found, expected, where=weights, ignore_unexpected_prefixes=ignored)


def from_pretrained_strictly(load, source, *model_args, without_heads: bool = False, **options):
    """``load(source, ...)`` (`PreTrainedModel.from_pretrained`) made strict: the checkpoint is checked
    (`check_checkpoint_file`, then transformers' loading report) and a mismatch raises
    `NeedleWeightsError` instead of a random initialisation; see `NeedlePreTrainedModel.from_pretrained`."""
    wants_loading_info = options.pop("output_loading_info", False)
    if options.pop("ignore_mismatched_sizes", False):
        raise ValueError("Needle checkpoints load exactly; `ignore_mismatched_sizes=True` is not supported")
    if without_heads:
        options.update(use_mtp_head=False, use_contrastive_head=False, use_confidence_head=False)
    # Let transformers report shape mismatches (instead of raising its own, version-specific error),
    # then refuse them below together with missing and unexpected tensors.
    model, loading_info = load(source, *model_args, output_loading_info=True, ignore_mismatched_sizes=True, **options)
    check_checkpoint_file(model, source, options, without_heads=without_heads)
    unused = HEAD_PREFIXES if without_heads else ()
    raise_unless_exact(model, loading_info, source, unused_prefixes=unused)
    if hasattr(model, "freeze_mtp_head"):
        model.freeze_mtp_head()  # transformers 5.x loads parameters anew, trainable
    return (model, loading_info) if wants_loading_info else model
