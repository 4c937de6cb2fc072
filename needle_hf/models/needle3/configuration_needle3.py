"""Needle 3 model configuration.

Needle 3 (cactus-needle 3.x) keeps Needle 2's hyper-connection lanes, zero-centred RMS norms and
engram memory, and changes the block: attention with separate query/key and value head widths and a
causal depthwise convolution over time on Q, K and V, sliding-window layers beside a list of global
layers, and a Monarch-style MLP (learned Kronecker factors, a low-rank per-token gain, fixed seeded
permutations). The output head is the token embedding cut to `out_vocab` rows.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..needle.config_fields import ConfigFields, EngramGeometry
from ..needle.config_fields import shown as _shown

# Rank of the Monarch MLP's per-token gain (`cond_v` [D, R] -> softmax -> `cond_u` [R, W]).
MLP_GAIN_RANK = 8

# Reference `TransformerConfig` field -> ours. Fields that steer only the reference's training or
# kernels (dtype, flash, remat, scan_unroll, ladder_sample) have no counterpart.
NATIVE_TO_HF_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_layers": "num_hidden_layers",
    "qk_head_dim": "head_dim",
    "v_head_dim": "value_head_dim",
    "max_seq_len": "max_position_embeddings",
    "pad_token_id": "pad_token_id",
    "embedding_dim": "embedding_dim",
    "embedding_probes": "embedding_probes",
    "embedding_queries": "embedding_queries",
    "confidence_probes": "confidence_probes",
    "confidence_queries": "confidence_queries",
    "router_probes": "router_probes",
    "router_queries": "router_queries",
    "rope_theta": "rope_theta",
    "engram_orders": "engram_orders",
    "engram_heads": "engram_heads",
    "engram_slots": "engram_slots",
    "engram_seed_heads": "engram_seed_heads",
    "engram_layers": "engram_layers",
    "global_layers": "global_layers",
    "sliding_window": "sliding_window",
    "ladder_depths": "ladder_depths",
    "ladder_widths": "ladder_widths",
    "ladder_order": "ladder_order",
    "mhc_lanes": "hyper_connection_lanes",
    "qkv_conv_taps": "qkv_conv_taps",
    "out_vocab": "out_vocab",
    "kv_window": "kv_window",
    "kv_bits": "kv_bits",
    "act_bits": "act_bits",
    "weight_bits": "weight_bits",
}

# Defaults of the reference `TransformerConfig` (cactus-needle 3.2.8).
NATIVE_DEFAULTS = {
    "vocab_size": 16384,
    "d_model": 768,
    "num_heads": 12,
    "num_kv_heads": 2,
    "num_layers": 20,
    "qk_head_dim": 48,
    "v_head_dim": 64,
    "max_seq_len": 4096,
    "pad_token_id": 0,
    "embedding_dim": 128,
    "embedding_probes": 4,
    "embedding_queries": 4,
    "confidence_probes": 4,
    "confidence_queries": 4,
    "router_probes": 4,
    "router_queries": 4,
    "rope_theta": 100000.0,
    "engram_orders": (2, 3),
    "engram_heads": 0,
    "engram_slots": 18432,
    "engram_seed_heads": 0,
    "engram_layers": (3, 7, 11, 15, 19),
    "global_layers": (4, 9, 14, 19),
    "sliding_window": 1024,
    "ladder_depths": (),
    "ladder_widths": (),
    "ladder_order": (),
    "mhc_lanes": 4,
    "qkv_conv_taps": 3,
    "out_vocab": 0,
    "kv_window": 0,
    "kv_bits": 8,
    "act_bits": 8,
    "weight_bits": "",
}

# A saved checkpoint config that lacks one of these fields predates it: the reference's loader
# (`TransformerConfig.from_saved`) reads the feature as off, not as the dataclass default.
NATIVE_ABSENT_MEANS_OFF = {
    "qk_head_dim": 0,
    "v_head_dim": 0,
    "sliding_window": 0,
    "global_layers": (),
    "ladder_depths": (),
    "ladder_widths": (),
    "ladder_order": (),
    "engram_seed_heads": 0,
    "qkv_conv_taps": 0,
    "out_vocab": 0,
}

MAX_LIST_FIELD_LENGTH = 256
_FIELDS = ConfigFields("Needle3Config", max_list_length=MAX_LIST_FIELD_LENGTH)
_integer, _integers, _real, _flag = _FIELDS.integer, _FIELDS.integers, _FIELDS.real, _FIELDS.flag


class Needle3Config(EngramGeometry, PretrainedConfig):
    r"""Configuration of a Needle 3 model (cactus-needle 3.x).

    Defaults are the reference's `TransformerConfig` defaults (d=768, 12 query and 2 key/value heads,
    20 layers, query/key heads of 48 and value heads of 64, sliding window 1024 with global layers
    4, 9, 14, 19, engram memory at layers 3, 7, 11, 15, 19). [`Needle3Config.from_needle_config`]
    resolves a checkpoint's saved config the way the reference's loader does.

    Args:
        vocab_size (`int`, *optional*, defaults to 16384): Rows of the token embedding.
        hidden_size (`int`, *optional*, defaults to 768): Residual width `D` (`d_model`).
        num_attention_heads (`int`, *optional*, defaults to 12): Query heads `N`.
        num_key_value_heads (`int`, *optional*, defaults to 2): Key/value heads `K` (grouped-query attention).
        num_hidden_layers (`int`, *optional*, defaults to 20): Decoder layers.
        head_dim (`int`, *optional*, defaults to 48): Query/key head width (`qk_head_dim`); 0 means
            `hidden_size // num_attention_heads`, as the reference.
        value_head_dim (`int`, *optional*, defaults to 64): Value head width (`v_head_dim`); 0 as above.
        max_position_embeddings (`int`, *optional*, defaults to 4096): Longest sequence (`max_seq_len`).
        rope_theta (`float`, *optional*, defaults to 100000.0): RoPE base (over `head_dim`).
        rms_norm_eps (`float`, *optional*, defaults to 1e-6): Epsilon of every RMS normalisation.
        sliding_window (`int`, *optional*, defaults to 1024): Layers not in `global_layers` see keys
            at distance < `sliding_window`; 0 makes every layer global.
        global_layers (`list[int]`, *optional*, defaults to `(4, 9, 14, 19)`): Layers that see the whole context.
        qkv_conv_taps (`int`, *optional*, defaults to 3): Taps of the causal depthwise convolution over
            time on the query, key and value projections; 0 turns it off.
        engram_orders (`list[int]`, *optional*, defaults to `(2, 3)`): n-gram orders the engram hashes.
        engram_heads (`int`, *optional*, defaults to 0): Hash heads per order; 0 picks
            `max(1, hidden_size // (len(engram_orders) * 128))`.
        engram_slots (`int`, *optional*, defaults to 18432): Rows of each engram hash table.
        engram_seed_heads (`int`, *optional*, defaults to 0): Stride of the hash seeds between orders
            (table of order index o and head h is seeded with `o * stride + h + 1`); 0 means `engram_heads`.
            A width-sliced model keeps its parent's stride.
        engram_layers (`list[int]`, *optional*, defaults to `(3, 7, 11, 15, 19)`): Layers that read engram memory.
        hyper_connection_lanes (`int`, *optional*, defaults to 4): Residual lanes (`mhc_lanes`).
        out_vocab (`int`, *optional*, defaults to 0): Rows of the tied output head (the first
            `out_vocab` embedding rows); 0 means `vocab_size`.
        ladder_depths / ladder_widths / ladder_order (`list[int]`, *optional*, default empty): the
            reference's nested early-exit rungs. `ladder_widths` non-empty splits the MLP's fixed
            permutations per half (so a half-width slice keeps its own permutation); `ladder_order`
            is the saved block selection order of a sliced model.
        embedding_dim (`int`, *optional*, defaults to 128): Output width of the embedding head.
        embedding_probes / embedding_queries, confidence_probes / confidence_queries,
        router_probes / router_queries (`int`, *optional*, default 4 each): Probe-pooling geometry of
            the three heads.
        use_embedding_head / use_confidence_head / use_router_head (`bool`, *optional*, default `False`):
            whether the checkpoint has that head's weights.
        kv_window (`int`, *optional*, defaults to 0), kv_bits (`int`, defaults to 8), act_bits (`int`,
            defaults to 8), weight_bits (`str`, defaults to `""`): deployment metadata kept for exports.
        initializer_range (`float`, *optional*, defaults to 0.02): Std of the normal initialiser.
        pad_token_id / bos_token_id / eos_token_id (`int`, *optional*, defaults to 0 / 2 / 1).
        use_cache (`bool`, *optional*, defaults to `True`).
    """

    model_type = "needle3"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=16384,
        hidden_size=768,
        num_attention_heads=12,
        num_key_value_heads=2,
        num_hidden_layers=20,
        head_dim=48,
        value_head_dim=64,
        max_position_embeddings=4096,
        rope_theta=100000.0,
        rms_norm_eps=1e-6,
        sliding_window=1024,
        global_layers=(4, 9, 14, 19),
        qkv_conv_taps=3,
        engram_orders=(2, 3),
        engram_heads=0,
        engram_slots=18432,
        engram_seed_heads=0,
        engram_layers=(3, 7, 11, 15, 19),
        hyper_connection_lanes=4,
        out_vocab=0,
        ladder_depths=(),
        ladder_widths=(),
        ladder_order=(),
        embedding_dim=128,
        embedding_probes=4,
        embedding_queries=4,
        confidence_probes=4,
        confidence_queries=4,
        router_probes=4,
        router_queries=4,
        use_embedding_head=False,
        use_confidence_head=False,
        use_router_head=False,
        kv_window=0,
        kv_bits=8,
        act_bits=8,
        weight_bits="",
        initializer_range=0.02,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        tie_word_embeddings=True,
        use_cache=True,
        **kwargs,
    ):
        self.vocab_size = _integer("vocab_size", vocab_size, minimum=1)
        self.hidden_size = _integer("hidden_size", hidden_size, minimum=1)
        self.num_attention_heads = _integer("num_attention_heads", num_attention_heads, minimum=1)
        self.num_key_value_heads = _integer("num_key_value_heads", num_key_value_heads, minimum=1)
        self.num_hidden_layers = _integer("num_hidden_layers", num_hidden_layers, minimum=1)
        fallback = self.hidden_size // self.num_attention_heads
        self.head_dim = _integer("head_dim", head_dim or fallback, minimum=1)
        self.value_head_dim = _integer("value_head_dim", value_head_dim or fallback, minimum=1)
        self.max_position_embeddings = _integer("max_position_embeddings", max_position_embeddings, minimum=1)
        self.rope_theta = _real("rope_theta", rope_theta)
        self.rms_norm_eps = _real("rms_norm_eps", rms_norm_eps)
        self.sliding_window = _integer("sliding_window", sliding_window or 0, minimum=0)
        self.global_layers = _integers("global_layers", global_layers, minimum=0)
        self.qkv_conv_taps = _integer("qkv_conv_taps", qkv_conv_taps, minimum=0, maximum=64)
        self.engram_orders = _integers("engram_orders", engram_orders, minimum=1)
        self.engram_heads = _integer("engram_heads", engram_heads, minimum=0)
        self.engram_slots = _integer("engram_slots", engram_slots, minimum=1)
        self.engram_seed_heads = _integer("engram_seed_heads", engram_seed_heads, minimum=0)
        self.engram_layers = _integers("engram_layers", engram_layers, minimum=0)
        self.hyper_connection_lanes = _integer("hyper_connection_lanes", hyper_connection_lanes, minimum=1)
        self.out_vocab = _integer("out_vocab", out_vocab, minimum=0)
        self.ladder_depths = _integers("ladder_depths", ladder_depths, minimum=0)
        self.ladder_widths = _integers("ladder_widths", ladder_widths, minimum=0)
        self.ladder_order = _integers("ladder_order", ladder_order, minimum=0)
        self.embedding_dim = _integer("embedding_dim", embedding_dim, minimum=1)
        for head in ("embedding", "confidence", "router"):
            setattr(self, f"{head}_probes", _integer(f"{head}_probes", locals()[f"{head}_probes"], minimum=1))
            setattr(self, f"{head}_queries", _integer(f"{head}_queries", locals()[f"{head}_queries"], minimum=1))
        self.use_embedding_head = _flag("use_embedding_head", use_embedding_head)
        self.use_confidence_head = _flag("use_confidence_head", use_confidence_head)
        self.use_router_head = _flag("use_router_head", use_router_head)
        self.kv_window = _integer("kv_window", kv_window, minimum=0)
        self.kv_bits = _integer("kv_bits", kv_bits, minimum=1)
        self.act_bits = _integer("act_bits", act_bits, minimum=1)
        if weight_bits is not None and not isinstance(weight_bits, str):
            raise ValueError(f"Invalid Needle3Config: weight_bits must be a string, got {_shown(weight_bits)}")
        self.weight_bits = weight_bits or ""
        self.initializer_range = _real("initializer_range", initializer_range)
        for name, token in (("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if token is not None:
                _integer(name, token, minimum=0, maximum=self.vocab_size - 1)
        self.use_cache = _flag("use_cache", use_cache)
        if not tie_word_embeddings:
            raise ValueError("Needle 3 ties its output head to the token embedding: tie_word_embeddings must be True")
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=True,
            **kwargs,
        )
        self.validate_geometry()

    # ----------------------------------------------------------------------------------------------
    # Derived geometry: the one place each derivation is written down.
    @property
    def query_dim(self) -> int:
        """Width of the query projection (and of the attention output and its gate): N * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def key_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_key_value_heads * self.value_head_dim

    @property
    def output_dim(self) -> int:
        """Width of the attention output fed to o_proj: N * value_head_dim."""
        return self.num_attention_heads * self.value_head_dim

    @property
    def output_vocab_size(self) -> int:
        """Rows of the tied output head (logits width)."""
        return self.out_vocab or self.vocab_size

    @property
    def layer_types(self) -> list[str]:
        return [
            "sliding_attention" if self.sliding_window and i not in self.global_layers else "full_attention"
            for i in range(self.num_hidden_layers)
        ]

    def layer_window(self, layer: int) -> int:
        """Keys a query of this layer sees: distance < window; 0 = the whole context."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0

    @property
    def engram_seed_stride(self) -> int:
        return self.engram_seed_heads or self.engram_num_heads

    @property
    def mlp_size(self) -> int:
        """Width `W` of the Monarch MLP: the next power of two >= hidden_size (zero padded)."""
        return 1 << (self.hidden_size - 1).bit_length()

    @property
    def mlp_factor_sizes(self) -> tuple[int, int]:
        """(a, b), a * b = mlp_size, a <= b: each stage maps z (as an [a, b] matrix Z) to Aᵀ Z B."""
        a = 1 << ((self.mlp_size - 1).bit_length() // 2)
        return a, self.mlp_size // a

    @property
    def mlp_split_permutations(self) -> bool:
        """The MLP's permutations act on each half separately when the model has width rungs."""
        return bool(self.ladder_widths)

    @property
    def mlp_gain_rank(self) -> int:
        return MLP_GAIN_RANK

    @property
    def probe_rows(self) -> int:
        """Pooled cells per position of the heads: the embeddings and every layer's lane mean."""
        return self.num_hidden_layers + 1

    def validate_geometry(self):
        """Raise `ValueError` naming the first inconsistent field (checks run in order)."""
        layers = self.num_hidden_layers
        checks = [
            (
                lambda: self.num_attention_heads % self.num_key_value_heads == 0,
                lambda: f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})",
            ),
            (lambda: self.head_dim % 2 == 0, lambda: f"head_dim ({self.head_dim}) must be even for the half-split RoPE"),
            (lambda: len(self.engram_orders) > 0, lambda: "engram_orders must name at least one n-gram order"),
            (
                lambda: self.engram_sub_dim >= 1,
                lambda: f"hidden_size ({self.hidden_size}) is smaller than the {self.engram_num_tables} engram tables",
            ),
            (
                lambda: all(layer < layers for layer in self.engram_layers),
                lambda: f"engram_layers {self.engram_layers} must lie in [0, num_hidden_layers={layers})",
            ),
            (
                lambda: all(layer < layers for layer in self.global_layers),
                lambda: f"global_layers {self.global_layers} must lie in [0, num_hidden_layers={layers})",
            ),
            (
                lambda: self.out_vocab <= self.vocab_size,
                lambda: f"out_vocab ({self.out_vocab}) must not exceed vocab_size ({self.vocab_size})",
            ),
            (
                lambda: not self.ladder_order or sorted(self.ladder_order) == list(range(layers)),
                lambda: f"ladder_order {self.ladder_order} must be a permutation of the {layers} layers",
            ),
            (
                lambda: not self.mlp_split_permutations or self.mlp_size >= 2,
                lambda: "ladder_widths needs an MLP width of at least 2 (permutations split per half)",
            ),
        ]
        for ok, message in checks:
            if not ok():
                raise ValueError(f"Invalid Needle3Config: {message()}")

    # ----------------------------------------------------------------------------------------------
    # Ladder early exit: nested sub-models that keep `depth` of the layers.
    def ladder_layer_order(self) -> tuple:
        """The order in which layers join the ladder's rungs: `ladder_order` when set, else the first
        and last layer, then repeatedly the middle of the widest gap between chosen layers (the
        leftmost gap on a tie), so every rung is spread evenly over the depth."""
        if self.ladder_order:
            return tuple(self.ladder_order)
        last = self.num_hidden_layers - 1
        if last == 0:
            return (0,)
        chosen = [0, last]
        while len(chosen) < self.num_hidden_layers:
            ordered = sorted(chosen)
            left, right = max(zip(ordered, ordered[1:]), key=lambda pair: (pair[1] - pair[0], -pair[0]))
            chosen.append((left + right) // 2)
        return tuple(chosen)

    def ladder_layers(self, depth: int) -> tuple:
        """The original layer indices (ascending) a rung of `depth` layers keeps: the first `depth`
        of `ladder_layer_order()`. A rung keeps at least 2 layers and fewer than all of them."""
        layers = self.num_hidden_layers
        if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth < layers:
            raise ValueError(
                f"ladder depth: expected an integer in [2, {layers - 1}] (at least 2 layers, fewer than "
                f"num_hidden_layers={layers}), got {_shown(depth)}")
        return tuple(sorted(self.ladder_layer_order()[:depth]))

    def ladder_config(self, depth: int) -> "Needle3Config":
        """The config of the rung of `depth` layers: `num_hidden_layers=depth`, and `ladder_order`,
        `global_layers` and `engram_layers` renumbered to the kept layers (those of dropped layers
        gone); `ladder_depths` cleared. Every other field is this config's."""
        if list(self.engram_layers) != sorted(self.engram_layers):
            raise ValueError(f"ladder_config: engram_layers must be ascending, got {list(self.engram_layers)}")
        kept = self.ladder_layers(depth)
        renumber = {layer: i for i, layer in enumerate(kept)}
        fields = self.to_dict()
        for name in ("model_type", "transformers_version", "architectures", "auto_map"):
            fields.pop(name, None)
        fields.update(
            num_hidden_layers=depth,
            ladder_order=[renumber[layer] for layer in self.ladder_layer_order() if layer in renumber],
            global_layers=[renumber[layer] for layer in self.global_layers if layer in renumber],
            engram_layers=[renumber[layer] for layer in self.engram_layers if layer in renumber],
            ladder_depths=[],
        )
        return type(self)(**fields)

    def save_pretrained(self, save_directory, push_to_hub=False, **kwargs):
        """`PretrainedConfig.save_pretrained`, plus the model code and `auto_map` beside config.json, so
        that the folder loads with `trust_remote_code=True` without needle_hf (see remote_code_needle3.py)."""
        from .remote_code_needle3 import write_remote_code

        self.to_json_string()  # refuses an unwritable field before any file is written
        write_remote_code(save_directory, self)
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    # ----------------------------------------------------------------------------------------------
    # Native (reference) config dicts.
    @classmethod
    def from_needle_config(cls, native: dict, **kwargs) -> "Needle3Config":
        """Build from a checkpoint's saved config dict, resolved as the reference's loader does:
        a missing field takes the reference default, except the features `NATIVE_ABSENT_MEANS_OFF`
        lists, which read as off. A Needle 2 config (`attn_dim` without `qk_head_dim`) is refused."""
        if not isinstance(native, dict):
            raise TypeError(f"a native Needle 3 config must be a dict, got {type(native).__name__}")
        if "attn_dim" in native and "qk_head_dim" not in native:
            raise ValueError(
                "this is a Needle 2 config (it has attn_dim and no qk_head_dim): convert it as Needle 2 "
                "(NeedleConfig.from_needle_config)")
        resolved = {**NATIVE_DEFAULTS, **NATIVE_ABSENT_MEANS_OFF}
        resolved.update({k: v for k, v in native.items() if k in NATIVE_DEFAULTS})
        fields = {hf: resolved[nat] for nat, hf in NATIVE_TO_HF_FIELDS.items()}
        fields.update(kwargs)
        return cls(**fields)

    def to_needle_config(self) -> dict:
        """The full native config dict (every field, with resolved head widths)."""
        native = {nat: getattr(self, hf) for nat, hf in NATIVE_TO_HF_FIELDS.items()}
        for name, value in native.items():
            if isinstance(value, list):
                native[name] = tuple(value)
        return native
