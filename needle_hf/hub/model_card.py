"""Model cards for Needle folders: `model_cards/needle2.md` rendered with `huggingface_hub.ModelCard`.

The card is the repository's README.md: YAML metadata the Hub indexes (`library_name`,
`pipeline_tag`, license, tags, `base_model`), then an architecture table computed from the config,
usage snippets (PyTorch, Flax, pipeline with tools) and, when the folder holds the converter's
`conversion_report.json`, the conversion provenance and the logit differences it measured.

Every figure in the card comes from the folder (config.json, the report); the template only lays
them out. The template ships in the wheel as the package `needle_hf.model_cards` (the repository's
`model_cards/` folder, mapped like `conversion/` is).
"""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from .. import __version__
from ..models.needle.configuration_needle import NeedleConfig
from ..conversion.convert import REPORT_NAME
from ..models.needle.weight_names import hf_weight_shapes

TEMPLATE_PACKAGE = "needle_hf.model_cards"
TEMPLATE_NAME = "needle2.md"

# Needle 2's license: cactus-needle 2.x declares "License: Apache-2.0" (its package metadata and LICENSE).
LICENSE = "apache-2.0"
LICENSE_NAME = "Apache 2.0"
# The Hub repository of the released Needle 2 weights, the `base_model` of a conversion of them.
NEEDLE2_REPO_ID = "Cactus-Compute/needle2"
TAGS = ("needle", "needle2", "tool-calling", "function-calling", "custom_code")


class ModelCardError(ValueError):
    """The folder cannot be described: its config or conversion report is missing or malformed."""


def parameter_count(config: NeedleConfig) -> int:
    """Parameters of a model with this config: every tensor of the weight table, the tied output
    head counted once (it is the embedding) and the optional heads when the config has them."""
    return sum(math.prod(shape) for shape in hf_weight_shapes(config).values())


def _short_count(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.1f}K"


def _listing(values) -> str:
    return ", ".join(str(value) for value in values)


def architecture_table(config: NeedleConfig) -> list[tuple[str, str]]:
    """(row name, value) pairs describing the geometry of `config`, for the card's table."""
    heads = [
        name
        for name, present in (
            ("multi-token prediction (t+2)", config.use_mtp_head),
            ("contrastive (tool retrieval)", config.use_contrastive_head),
            ("confidence", config.use_confidence_head),
        )
        if present
    ]
    count = parameter_count(config)
    return [
        ("Parameters", f"{count:,} ({_short_count(count)}; output head tied to the embedding)"),
        ("Vocabulary", f"{config.vocab_size:,} (SentencePiece BPE, byte fallback)"),
        ("Decoder layers", str(config.num_hidden_layers)),
        ("Hidden size", str(config.hidden_size)),
        (
            "Attention",
            f"{config.num_attention_heads} query heads, {config.num_key_value_heads} key/value heads, "
            f"head_dim {config.head_dim}; q/k norms, sigmoid output gate",
        ),
        ("Positions", f"RoPE (theta {config.rope_theta:g}), up to {config.max_position_embeddings:,} tokens"),
        ("MLP", f"Hadamard MLP, width {config.hadamard_size}"),
        ("Engram memory layers", _listing(config.engram_layers)),
        ("Engram n-gram orders", _listing(config.engram_orders)),
        (
            "Engram tables",
            f"{config.engram_num_tables} ({config.engram_num_heads} hash heads per order), "
            f"{config.engram_slots:,} slots of width {config.engram_sub_dim} each",
        ),
        (
            "Engram convolution",
            f"{config.engram_conv_taps} taps, dilation {config.engram_conv_dilation} "
            f"(an output reads {config.engram_history} earlier tokens)",
        ),
        ("Hyper-connection lanes", str(config.hyper_connection_lanes)),
        ("Extra heads", _listing(heads) if heads else "none"),
    ]


def _figure(value, spec: str) -> str | None:
    return None if value is None else format(value, spec)


def conversion_summary(report: dict) -> dict:
    """The provenance and parity rows of a `conversion_report.json`, formatted for the card.

    Rows whose figure the report does not hold are left out, so a report written without the logit
    check (converted without `--verify-with`) yields a card that says so instead of a blank.
    """
    if not isinstance(report, dict):
        raise ModelCardError(f"{REPORT_NAME} must hold a JSON object, got {type(report).__name__}")
    converter = report.get("converter") or {}
    source = report.get("source") or {}
    output = report.get("output") or {}
    verification = report.get("verification") or {}
    rows = []
    if source.get("file"):
        rows.append(("Source file", f"`{source['file']}` ({source.get('format', 'unknown format')})"))
    if source.get("sha256"):
        rows.append(("Source sha256", f"`{source['sha256']}`"))
    if source.get("dtype") or output.get("dtype"):
        rows.append(("Weights dtype", f"{source.get('dtype', '?')} in the source, {output.get('dtype', '?')} here"))
    if verification.get("tensors_bit_exact"):
        rows.append(("Tensors read back", "bit-exact"))
    logit_diff = verification.get("max_abs_logit_diff")
    if logit_diff is None:
        rows.append(("Logit check", "not run"))
    else:
        backend = verification.get("backend")
        tokens = verification.get("tokens") or []
        check = f"{logit_diff:.2e}"
        if verification.get("tolerance") is not None:
            check += f" (tolerance {verification['tolerance']:.1e})"
        rows.append(("Max abs logit difference vs source", check))
        mtp = _figure(verification.get("max_abs_mtp_logit_diff"), ".2e")
        if mtp is not None:
            rows.append(("Max abs MTP logit difference", mtp))
        scale = _figure(verification.get("max_abs_logit"), ".2f")
        if scale is not None:
            rows.append(("Logit scale (max abs)", scale))
        measured = "the loaded " + (f"{backend} model" if backend else "model")
        if tokens:
            measured += f" on {len(tokens)} tokens"
        if verification.get("reference"):
            measured += f", against {verification['reference']}"
        rows.append(("Measured with", measured))
    rounding = _figure(verification.get("output_dtype_rounding_max_abs_logit_change"), ".2e")
    if rounding is not None:
        rows.append(("Logit change from rounding to the output dtype", rounding))
    return {
        "converter_version": converter.get("version", "unknown"),
        "created": report.get("created_utc"),
        "rows": rows,
    }


def card_metadata(*, base_model: str | None = None) -> ModelCardData:
    """The YAML metadata of a Needle card."""
    return ModelCardData(
        license=LICENSE,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(TAGS),
        base_model=base_model,
    )


def read_template() -> str:
    """The card template, from the installed package data."""
    return resources.files(TEMPLATE_PACKAGE).joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")


def render_model_card(
    config: NeedleConfig,
    *,
    repo_id: str,
    conversion_report: dict | None = None,
    base_model: str | None = None,
) -> ModelCard:
    """Render the Needle model card.

    Args:
        config: the model's config (the architecture table is computed from it).
        repo_id: the Hub repository the card describes (`org/name`), used in the usage snippets.
        conversion_report: the parsed `conversion_report.json`, when the folder has one.
        base_model: the Hub repository the weights come from (e.g. `NEEDLE2_REPO_ID` for a conversion
            of the released checkpoint), or None when unknown.

    Returns:
        A `huggingface_hub.ModelCard` (`str(card)` is the README text, `card.data` the metadata).
    """
    if "/" not in repo_id:
        raise ModelCardError(f"repo_id must be 'org/name', got {repo_id!r}")
    count = parameter_count(config)
    return ModelCard.from_template(
        card_data=card_metadata(base_model=base_model),
        template_str=read_template(),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        parameters_short=_short_count(count),
        architecture=architecture_table(config),
        conversion=conversion_summary(conversion_report) if conversion_report is not None else None,
        package_version=__version__,
        license_name=LICENSE_NAME,
    )


def read_conversion_report(folder: str | os.PathLike) -> dict | None:
    """The folder's parsed `conversion_report.json`, or None when it has none."""
    path = Path(folder) / REPORT_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelCardError(f"{path}: not valid JSON ({error})") from None


def folder_model_card(folder: str | os.PathLike, *, repo_id: str, base_model: str | None = None) -> ModelCard:
    """The card of a saved Needle folder (its config.json and, if present, its conversion report)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelCardError(f"{folder}: no config.json; expected a saved Hugging Face Needle folder")
    config = NeedleConfig.from_pretrained(str(folder))
    return render_model_card(
        config, repo_id=repo_id, conversion_report=read_conversion_report(folder), base_model=base_model
    )


__all__ = [
    "LICENSE",
    "NEEDLE2_REPO_ID",
    "ModelCardError",
    "architecture_table",
    "card_metadata",
    "conversion_summary",
    "folder_model_card",
    "parameter_count",
    "read_conversion_report",
    "render_model_card",
]
