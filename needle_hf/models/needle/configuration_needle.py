"""Needle 2 model configuration.

This file is also written next to saved weights as remote code for users who load with
``trust_remote_code=True``; its only package import (remote_code.py, when saving) travels with it.
"""

import json
import math

import transformers
from transformers import PretrainedConfig

from .config_fields import ENGRAM_CONV_TAPS, ENGRAM_TARGET_SUB_DIM, EngramGeometry  # noqa: F401  (names of this module too)
from .config_fields import MAX_FIELD_VALUE, ConfigFields  # noqa: F401  (MAX_FIELD_VALUE: part of this module's names)
from .config_fields import shown as _shown

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
DEFAULT_ROPE_THETA = 100000.0
DEFAULT_ROPE_TYPE = "default"
# Written to every config.json whatever their value (transformers 5.x gives them no defaults).
DECLARED_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings")


# Field names of the reference `TransformerConfig` mapped to ours. Fields that only steer the
# reference's training or kernels (flash, remat, scan_unroll, dtype) have no counterpart.
NATIVE_TO_HF_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "attn_dim": "attention_dim",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_layers": "num_hidden_layers",
    "max_seq_len": "max_position_embeddings",
    "pad_token_id": "pad_token_id",
    "contrastive_dim": "contrastive_dim",
    "rope_theta": "rope_theta",
    "engram_orders": "engram_orders",
    "engram_heads": "engram_heads",
    "engram_slots": "engram_slots",
    "engram_layers": "engram_layers",
    "mhc_lanes": "hyper_connection_lanes",
    "kv_window": "kv_window",
    "kv_bits": "kv_bits",
    "act_bits": "act_bits",
    "weight_bits": "weight_bits",
}

# Defaults of the reference `TransformerConfig` (cactus-needle 2.x). A saved native config holds only
# the fields that were overridden, so every missing field resolves against these.
NATIVE_DEFAULTS = {
    "vocab_size": 8192,
    "d_model": 512,
    "attn_dim": 0,
    "num_heads": 8,
    "num_kv_heads": 4,
    "num_layers": 12,
    "max_seq_len": 2048,
    "pad_token_id": 0,
    "contrastive_dim": 128,
    "rope_theta": 100000.0,
    "dtype": "bfloat16",
    "engram_orders": (2, 3),
    "engram_heads": 0,
    "engram_slots": 8192,
    "engram_layers": (2, 15),
    "mhc_lanes": 4,
    "kv_window": 0,
    "kv_bits": 8,
    "act_bits": 8,
    "weight_bits": "",
}


# Widths the deployment numerics compute exactly. Activations: per-row absmax levels
# +-(2**(act_bits - 1) - 1) in float32, whose integers are exact only up to 2**24 (and one bit
# leaves no magnitude level), hence act_bits in [2, 25]. KV cache: CQ codebooks exist for 2, 3 and 4
# bits; 8 and up keep the engine's int8 cache unquantised.
ACT_BITS_RANGE = (2, 25)
KV_CQ_BITS = (2, 3, 4)
KV_BITS_UNQUANTISED = 8
MAX_LIST_FIELD_LENGTH = 64
_FIELDS = ConfigFields("NeedleConfig", max_list_length=MAX_LIST_FIELD_LENGTH)
_integer, _integers, _real, _flag = _FIELDS.integer, _FIELDS.integers, _FIELDS.real, _FIELDS.flag


def _holds_non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_holds_non_finite(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_non_finite(item) for item in value)
    return False


def _rope_theta(rope_theta, rope_parameters) -> float:
    """The RoPE base from either spelling: `rope_theta` (4.57) or `rope_parameters` (5.x)."""
    if rope_parameters is not None:
        if not isinstance(rope_parameters, dict):
            raise ValueError(f"Invalid NeedleConfig: rope_parameters must be a dict, got {_shown(rope_parameters)}")
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", DEFAULT_ROPE_TYPE))
        unknown = sorted(set(rope_parameters) - {"rope_type", "type", "rope_theta"})
        if rope_type != DEFAULT_ROPE_TYPE or unknown:
            raise ValueError(f"Invalid NeedleConfig: Needle uses plain RoPE (rope_type 'default', rope_theta only), "
                             f"got rope_parameters {_shown(rope_parameters)}")
        if rope_parameters.get("rope_theta") is not None:
            theta = _real("rope_parameters['rope_theta']", rope_parameters["rope_theta"])
            if rope_theta is not None and _real("rope_theta", rope_theta) != theta:
                raise ValueError(f"Invalid NeedleConfig: rope_theta {rope_theta} and rope_parameters['rope_theta'] "
                                 f"{theta} disagree")
            return theta
    return _real("rope_theta", DEFAULT_ROPE_THETA if rope_theta is None else rope_theta)


class NeedleConfig(EngramGeometry, PretrainedConfig):
    r"""Configuration of a Needle 2 model (Cactus Compute's Simple Attention Network).

    Defaults describe the released Needle 2 geometry (the reference's ``base`` preset: d=512, 8 query
    and 4 key/value heads, 27 layers, engram memory at layers 2 and 15; 44,938,997 parameters). The
    reference's own dataclass default of 12 layers cannot hold its default engram layer 15;
    [`NeedleConfig.from_needle_config`] resolves a saved native config against those native defaults.

    Args:
        vocab_size (`int`, *optional*, defaults to 8192): Vocabulary size.
        hidden_size (`int`, *optional*, defaults to 512): Residual width `d` (`d_model`).
        attention_dim (`int`, *optional*, defaults to `None`): Width of the query/gate projections;
            `None` or 0 means `hidden_size` (the reference's `attn_dim=0`).
        num_attention_heads (`int`, *optional*, defaults to 8): Query heads.
        num_key_value_heads (`int`, *optional*, defaults to 4): Key/value heads (grouped-query attention).
        num_hidden_layers (`int`, *optional*, defaults to 27): Decoder layers.
        max_position_embeddings (`int`, *optional*, defaults to 2048): Longest sequence (`max_seq_len`).
        rope_theta (`float`, *optional*, defaults to 100000.0): RoPE base.
        rope_parameters (`dict`, *optional*): transformers 5.x's spelling of the RoPE settings,
            ``{"rope_type": "default", "rope_theta": float}`` (Needle has no RoPE scaling). Either
            spelling is read on either version (both must agree when both are given); the config
            keeps `rope_theta` and, on transformers 5.x, `rope_parameters`.
        rms_norm_eps (`float`, *optional*, defaults to 1e-6): Epsilon of every RMS normalisation.
        engram_orders (`tuple[int]`, *optional*, defaults to `(2, 3)`): n-gram orders hashed by the
            engram memory.
        engram_heads (`int`, *optional*, defaults to 0): Hash heads per order; 0 picks
            `max(1, hidden_size // (len(engram_orders) * 128))` like the reference.
        engram_slots (`int`, *optional*, defaults to 8192): Rows of each engram hash table.
        engram_layers (`tuple[int]`, *optional*, defaults to `(2, 15)`): Layers that read engram memory.
        hyper_connection_lanes (`int`, *optional*, defaults to 4): Residual lanes of the
            hyper-connections (`mhc_lanes`).
        contrastive_dim (`int`, *optional*, defaults to 128): Output width of the contrastive head.
        use_mtp_head (`bool`, *optional*, defaults to `True`): Whether the multi-token-prediction head
            (predicts token t+2) has weights.
        use_contrastive_head (`bool`, *optional*, defaults to `False`): Whether the checkpoint has the
            contrastive (tool retrieval) head.
        use_confidence_head (`bool`, *optional*, defaults to `False`): Whether the checkpoint has the
            confidence head.
        kv_window (`int`, *optional*, defaults to 0): Sliding KV window the model was trained for
            (metadata for deployment exports; the HF models attend to the whole context).
        attention_window (`int`, *optional*, defaults to 0): Sliding attention window the HF models
            apply: 0 attends to the whole context (default, as the reference's forward); ``n > 0``
            lets each token see only the last ``n`` positions, as the engine decodes with its KV
            window (`needle_hf.generation.kv_window.engine_kv_window` gives the window the engine derives).
        kv_bits (`int`, *optional*, defaults to 8): KV-cache width of deployment exports: 2, 3 or 4
            and the engine CQ-quantises the cache (and so does `deploy_numerics`); 8 and up keep it int8.
        act_bits (`int`, *optional*, defaults to 8): Activation width of deployment exports (and of
            `deploy_numerics`), 2 to 25 (see `ACT_BITS_RANGE`).
        weight_bits (`str`, *optional*, defaults to `""`): Mixed-precision CQ weight map,
            ``"name=bits,...,default=bits"`` (widths 2, 3, 4 or 1.58 = ternary; whole tensor names
            such as ``attn.q_proj``, ``engram0.tables``, ``embedding``, or groups ``attn``, ``engram``,
            ``mhc_phi``, ``mtp``; an unknown name is an error; see `needle_hf.models.needle.numerics.parse_bits_map`): the widths `needle-hf build` uses when given no
            ``--bits``/``--bits-map``, and those of the QAT weights under `deploy_numerics`.
        deploy_numerics (`bool`, *optional*, defaults to `False`): Compute what the Needle engine computes
            from the `.cact` (the reference's `quant=True` forward): int8 (`act_bits`) per-row absmax
            fake quantisation of the activations entering the attention, the attention output, the
            engram rows, the final hidden state and the MTP inputs; a CQ-quantised KV cache (groups of
            64) when `kv_bits` < 8; and, in training mode only (QAT), CQ fake-quantised weights
            (the `weight_bits` map's widths, else 4 bits; groups of 128) with straight-through gradients. Evaluate
            with it on weights dequantised from a `.cact` to see the shipped model's accuracy; train
            with it (also through PEFT) to make the model robust to the deployed quantisation.
        initializer_range (`float`, *optional*, defaults to 0.02): Std of the normal initialiser.
        pad_token_id / bos_token_id / eos_token_id (`int`, *optional*, defaults to 0 / 2 / 1).
        tie_word_embeddings (`bool`, *optional*, defaults to `True`): Needle always ties the output head
            to the token embedding.
            These four are set on the config itself and always written to config.json: transformers
            5.x no longer gives them defaults.

    Names transformers 5.x's cache and masks read (`layer_types`, `sliding_window`,
    `attention_chunk_size`) are not Needle fields: Needle's window is `attention_window` (applied by
    its own masks) and `kv_window` (deployment metadata), so a transformers cache built from this
    config is a plain full-attention one.
        use_cache (`bool`, *optional*, defaults to `True`): Whether the forward returns (and `generate`
            decodes with) a KV cache when the call does not say.
    """

    model_type = "needle2"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=8192,
        hidden_size=512,
        attention_dim=None,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=27,
        max_position_embeddings=2048,
        rope_theta=None,
        rms_norm_eps=1e-6,
        engram_orders=(2, 3),
        engram_heads=0,
        engram_slots=8192,
        engram_layers=(2, 15),
        hyper_connection_lanes=4,
        contrastive_dim=128,
        use_mtp_head=True,
        use_contrastive_head=False,
        use_confidence_head=False,
        kv_window=0,
        attention_window=0,
        kv_bits=8,
        act_bits=8,
        weight_bits="",
        deploy_numerics=False,
        initializer_range=0.02,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        tie_word_embeddings=True,
        use_cache=True,
        rope_parameters=None,
        **kwargs,
    ):
        self.vocab_size = _integer("vocab_size", vocab_size, minimum=1)
        self.hidden_size = _integer("hidden_size", hidden_size, minimum=1)
        self.attention_dim = _integer("attention_dim", attention_dim or hidden_size, minimum=1)
        self.num_attention_heads = _integer("num_attention_heads", num_attention_heads, minimum=1)
        self.num_key_value_heads = _integer("num_key_value_heads", num_key_value_heads, minimum=1)
        self.num_hidden_layers = _integer("num_hidden_layers", num_hidden_layers, minimum=1)
        self.max_position_embeddings = _integer("max_position_embeddings", max_position_embeddings, minimum=1)
        self.rope_theta = _rope_theta(rope_theta, rope_parameters)
        self.rms_norm_eps = _real("rms_norm_eps", rms_norm_eps)
        self.engram_orders = _integers("engram_orders", engram_orders, minimum=1)
        self.engram_heads = _integer("engram_heads", engram_heads, minimum=0)
        self.engram_slots = _integer("engram_slots", engram_slots, minimum=1)
        self.engram_layers = _integers("engram_layers", engram_layers, minimum=0)
        self.hyper_connection_lanes = _integer("hyper_connection_lanes", hyper_connection_lanes, minimum=1)
        self.contrastive_dim = _integer("contrastive_dim", contrastive_dim, minimum=1)
        self.use_mtp_head = _flag("use_mtp_head", use_mtp_head)
        self.use_contrastive_head = _flag("use_contrastive_head", use_contrastive_head)
        self.use_confidence_head = _flag("use_confidence_head", use_confidence_head)
        self.kv_window = _integer("kv_window", kv_window, minimum=0)
        self.attention_window = _integer("attention_window", attention_window, minimum=0)
        self.kv_bits = _integer("kv_bits", kv_bits, minimum=1)
        if self.kv_bits not in KV_CQ_BITS and self.kv_bits < KV_BITS_UNQUANTISED:
            raise ValueError(f"Invalid NeedleConfig: kv_bits must be 2, 3 or 4 (a CQ-quantised KV cache) or "
                             f"{KV_BITS_UNQUANTISED} and up (int8, unquantised), got {self.kv_bits}")
        self.act_bits = _integer("act_bits", act_bits, minimum=ACT_BITS_RANGE[0], maximum=ACT_BITS_RANGE[1])
        if weight_bits is not None and not isinstance(weight_bits, str):
            raise ValueError(f"Invalid NeedleConfig: weight_bits must be a string, got {_shown(weight_bits)}")
        self.weight_bits = weight_bits or ""
        self.initializer_range = _real("initializer_range", initializer_range)
        for name, token in (("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if token is not None:
                _integer(name, token, minimum=0, maximum=self.vocab_size - 1)
        self.use_cache = _flag("use_cache", use_cache)
        self.deploy_numerics = _flag("deploy_numerics", deploy_numerics)
        if not tie_word_embeddings:
            raise ValueError("Needle ties its output head to the token embedding: tie_word_embeddings must be True")
        if TRANSFORMERS_MAJOR >= 5:
            # Read by 5.x's PretrainedConfig.__init__, which fills in the theta from `self.rope_theta`.
            self.rope_parameters = {"rope_type": DEFAULT_ROPE_TYPE, "rope_theta": self.rope_theta}
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=True,
            **kwargs,
        )
        # Declared here, not left to PretrainedConfig (5.x no longer defaults them).
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
        self.tie_word_embeddings = True
        self.validate_geometry()

    def to_diff_dict(self) -> dict:
        """`PretrainedConfig.to_diff_dict`, always with the token ids and `tie_word_embeddings` (which
        4.57 leaves out when they equal its defaults, and 5.x has no defaults for)."""
        diff = super().to_diff_dict()
        for name in DECLARED_FIELDS:
            diff[name] = getattr(self, name)
        return diff

    # ----------------------------------------------------------------------------------------------
    # Derived geometry: the one place each derivation is written down.
    @property
    def head_dim(self) -> int:
        return self.attention_dim // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def hadamard_size(self) -> int:
        """Width of the Hadamard MLP: the next power of two >= hidden_size (zero padded)."""
        return 1 << (self.hidden_size - 1).bit_length()

    def validate_geometry(self):
        """Raise `ValueError` naming the first inconsistent field (checks run in order, so a derived
        quantity is only examined once the fields it depends on are valid)."""
        checks = [
            (lambda: self.vocab_size > 0, lambda: f"vocab_size must be positive, got {self.vocab_size}"),
            (lambda: self.hidden_size > 0, lambda: f"hidden_size must be positive, got {self.hidden_size}"),
            (lambda: self.num_hidden_layers > 0, lambda: f"num_hidden_layers must be positive, got {self.num_hidden_layers}"),
            (lambda: self.num_attention_heads > 0, lambda: f"num_attention_heads must be positive, got {self.num_attention_heads}"),
            (
                lambda: self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads == 0,
                lambda: f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})",
            ),
            (
                lambda: self.attention_dim % self.num_attention_heads == 0,
                lambda: f"num_attention_heads ({self.num_attention_heads}) must divide attention_dim ({self.attention_dim})",
            ),
            (lambda: self.head_dim % 2 == 0, lambda: f"head_dim ({self.head_dim}) must be even for the half-split RoPE"),
            (lambda: self.max_position_embeddings > 0, lambda: "max_position_embeddings must be positive"),
            (lambda: self.hyper_connection_lanes > 0, lambda: "hyper_connection_lanes must be positive"),
            (lambda: len(self.engram_orders) > 0, lambda: "engram_orders must name at least one n-gram order"),
            (lambda: all(o >= 1 for o in self.engram_orders), lambda: f"engram_orders must be >= 1, got {self.engram_orders}"),
            (lambda: self.engram_heads >= 0, lambda: f"engram_heads must be >= 0 (0 = auto), got {self.engram_heads}"),
            (lambda: self.engram_slots > 0, lambda: f"engram_slots must be positive, got {self.engram_slots}"),
            (
                lambda: self.engram_sub_dim >= 1,
                lambda: f"hidden_size ({self.hidden_size}) is smaller than the {self.engram_num_tables} engram tables",
            ),
            (
                lambda: len(set(self.engram_layers)) == len(self.engram_layers),
                lambda: f"engram_layers has duplicates: {self.engram_layers}",
            ),
            (
                lambda: all(0 <= layer < self.num_hidden_layers for layer in self.engram_layers),
                lambda: f"engram_layers {self.engram_layers} must lie in [0, num_hidden_layers={self.num_hidden_layers})",
            ),
        ]
        for ok, message in checks:
            if not ok():
                raise ValueError(f"Invalid NeedleConfig: {message()}")
        if self.weight_bits:
            from .numerics import BitsMapError, parse_bits_map

            try:
                parse_bits_map(self.weight_bits, engram_sites=len(self.engram_layers))
            except BitsMapError as error:
                raise ValueError(f"Invalid NeedleConfig: weight_bits: {error}") from None

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """`PretrainedConfig.from_dict`, the path of every load of a config.json: an invalid field is
        reported as a `ValueError` naming config.json and the field."""
        try:
            return super().from_dict(config_dict, **kwargs)
        except ValueError as error:
            if not str(error).startswith("Invalid NeedleConfig"):
                raise
            raise ValueError(f"config.json: {error}") from None

    def to_json_string(self, use_diff: bool = True) -> str:
        """`PretrainedConfig.to_json_string`, refusing a non-finite number in any field: JSON has none,
        and a `NaN` written into config.json would make the file unreadable to strict parsers."""
        text = super().to_json_string(use_diff=use_diff)
        found = []
        json.loads(text, parse_constant=found.append)
        if found:
            fields = [name for name, value in self.to_dict().items() if _holds_non_finite(value)]
            raise ValueError(f"Invalid NeedleConfig: field {', '.join(fields) or '?'} holds {found[0]}; config.json "
                             "holds finite numbers only")
        return text

    def save_pretrained(self, save_directory, push_to_hub=False, **kwargs):
        """`PretrainedConfig.save_pretrained`, plus the model code and `auto_map` beside config.json, so
        that the folder loads with `trust_remote_code=True` without needle_hf (see remote_code.py).

        Every model save and the converter go through here, after `push_to_hub` has recorded its file
        timestamps, so the code files are uploaded too."""
        from .remote_code import write_remote_code

        self.to_json_string()  # refuses an unwritable field before any file is written
        write_remote_code(save_directory, self)
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    # ----------------------------------------------------------------------------------------------
    # Native (reference) config dicts.
    @classmethod
    def from_needle_config(cls, native: dict, **kwargs) -> "NeedleConfig":
        """Build from the reference's saved config dict, which holds only the overridden fields.

        Fields that only steer the reference's training (dtype, flash, remat, ...) are ignored, as the
        reference ignores unknown keys.
        """
        if not isinstance(native, dict):
            raise TypeError(f"a native Needle config must be a dict, got {type(native).__name__}")
        resolved = dict(NATIVE_DEFAULTS)
        resolved.update({k: v for k, v in native.items() if k in NATIVE_DEFAULTS})
        fields = {hf: resolved[nat] for nat, hf in NATIVE_TO_HF_FIELDS.items()}
        fields.update(kwargs)
        return cls(**fields)

    def to_needle_config(self) -> dict:
        """The full native config dict (every field, so no reader depends on native defaults)."""
        native = {nat: getattr(self, hf) for nat, hf in NATIVE_TO_HF_FIELDS.items()}
        native["engram_orders"] = tuple(native["engram_orders"])
        native["engram_layers"] = tuple(native["engram_layers"])
        return native
