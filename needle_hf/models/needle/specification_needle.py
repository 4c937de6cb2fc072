"""The specification the PyTorch and the Flax Needle 2 models share (framework-free).

The two models share no array code; they share this: the axis legend, each op's numerical choice,
the rules both implement (the attention mask with its window and padding rows, the position limit,
the prompt check), the one exception of strict loading, and the names and argument orders of the
helpers each defines. `tests/models/test_twin_ops.py` runs both models' helpers on the same inputs;
`tests/models/test_ops_parity.py` pins them to the NumPy statement (`conversion/native_forward.py`).

Axis legend (shape comments and einsum strings of both models and the NumPy statement; lower case
in einsum strings; `tests/models/test_axis_legend.py` holds every bracketed shape of both models to it):

  ====  ==============================================  ====  =====================================
  B     batch                                           V     vocabulary
  T     query positions (new tokens)                    S     key positions (past + new, or a
                                                              static cache's length)
  D     hidden width (d_model)                          A     attention width (N * H)
  N     query heads                                     K     key/value heads
  G     query heads per kv head (N / K)                 H     head_dim
  L     hyper-connection lanes                          I, J  lanes as rows and columns of a
                                                              lane-mixing matrix
  C     engram context positions                        E     engram input width (tables * sub_dim)
  W     Hadamard width (a power of two >= D)            P     pooling probes
  F     pooled cells (position, layer) of probe         R     engram lookback reach (a token and
        pooling                                               the engram_history positions before it)
  Q     sequences of a packed batch                     M     positions of one packed sequence
  ====  ==============================================  ====  =====================================

One numerical choice per op (both models; the compute dtype is the parameters' dtype):

  =====================  =====================================================================
  embedding              ``E[tokens]`` in float32 times ``sqrt(D)`` (`embedding_scale`), then
                         cast to the compute dtype
  RMS norms              mean of squares in float32; ``(1 + w) * x`` in the input dtype, divided
                         in float32, cast back (`zero_centred_rms_norm`); `rms_unit` is float32
  RoPE                   half-split; `rope_tables(position_ids, inverse_frequencies)` in float32
                         (inverse frequencies: `numerics.rope_inverse_frequencies`);
                         `apply_rotary(x, cos, sin)` in float32, cast back
  attention              scores and softmax in float32, probabilities cast to the value dtype;
                         mask: `attention_rule`
  Hadamard MLP           `walsh_transform(z, walsh)`: the Kronecker factors of the Walsh matrix,
                         or under deploy numerics the matrix itself (`walsh_operand_names`)
  hyper-connections      routing in float32 from `rms_unit` of the flat lanes; the lane-mixing
                         matrix is `sinkhorn(logits, iterations)` inside the hyper-connection
                         module (`SINKHORN_ITERATIONS` rounds, linear space unless the logits
                         spread wider than `SINKHORN_LINEAR_SPACE_MAX_SPREAD`)
  engram gate            float32
  logits                 ``float32(h) @ float32(E)^T``
  probe-pooling heads    read the cells (``x0`` and the lane mean after each layer) with the
                         gradient stopped, as the reference's contrastive and confidence forwards
  =====================  =====================================================================
"""

from __future__ import annotations

# Helper names both modeling files define, with the same argument order (checked by test_twin_ops).
TWIN_HELPERS = (
    "zero_centred_rms_norm",  # (x, weight, eps)
    "rms_unit",  # (x, eps)
    "rope_tables",  # (position_ids, inverse_frequencies)
    "apply_rotary",  # (x, cos, sin)
    "shift_right",  # (x, offset)
    "log_space_sinkhorn",  # (logits, iterations)
    "sinkhorn",  # (logits, iterations)
    "walsh_transform",  # (z, walsh)
    "engram_hash_indices",  # (tokens, orders, num_heads, slots)
    "add_engram_read",  # (u, engram_key, engram_value, eps)
    "packed_segment_ids",  # (position_ids)
    "probe_pool",  # (cells, keep, probes)
    "check_prompt_ids",  # (input_ids, vocab_size)
    "check_position_ids",  # (position_ids, input_shape)
)


class NeedleWeightsError(ValueError):
    """A checkpoint's tensors do not match the model the config describes (missing, unexpected or mis-shaped).

    The one exception of strict loading in both models, the converters and the weight table.
    """


def embedding_scale(hidden_size: int) -> float:
    """The factor of the token embedding, ``sqrt(D)``, applied in float32 before the cast."""
    return float(hidden_size) ** 0.5


def attention_rule(query_positions, key_positions, key_visible, *, window: int = 0):
    """Which keys each query attends to, for arrays of any framework that broadcast.

    query_positions [T, 1] and key_positions [1, S] (integers), key_visible [B, 1, S] bool (True: a
    real token) -> [B, T, S] bool. A query sees the keys at or before it that are real tokens, and
    with ``window = n > 0`` only the last ``n`` of them (``query - key < n``: the engine's sliding KV
    window, `needle_hf.generation.kv_window`). It always sees itself: a padding row (a query at a
    hidden position, which sees no real key) stays finite and depends on nothing else, and a real
    position sees itself anyway.
    """
    causal = key_positions <= query_positions
    if window > 0:
        causal = causal & (query_positions - key_positions < window)
    return (causal & key_visible) | (key_positions == query_positions)


def attention_window_option(value) -> int:
    """An ``attention_window`` passed to a forward or `generate`: an int >= 0 (0: full attention)."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < 0:
        raise ValueError(f"attention_window: expected an int >= 0 (0: full attention), found {value!r}")
    return int(value)


def logits_to_keep_option(value) -> int:
    """A causal LM's ``logits_to_keep`` as an int: the last ``n`` positions' logits, 0 keeps all."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"logits_to_keep: expected an int >= 0 (0 keeps all), found {value!r}")
    return value


def check_positions(positions: int, max_position_embeddings: int) -> None:
    """The text must fit the positions the model was trained for.

    Both twins check it at the same two points: a forward without a cache (`positions_taken`; the
    causal LM, the backbone and the probe-pooling heads alike), and the start of `generate`, before any
    decoding (the prompt plus the new tokens it may add: ``max_length``, or prompt + ``max_new_tokens``).
    A forward with a cache is a step of some decoding, whose start was checked. Under tracing
    (``torch.compile``, ``jax.jit``) a forward's position ids have no value to check.
    """
    if positions > max_position_embeddings:
        raise ValueError(
            f"the text reaches {positions} positions, more than max_position_embeddings="
            f"{max_position_embeddings}; shorten the prompt or max_new_tokens"
        )


def positions_taken(length: int, largest_position: int | None) -> int:
    """The positions a forward over whole texts takes: its largest position id plus one when the call
    gives position ids (the sequences of a packed batch restart theirs), else its length T (the
    default positions, counted from 0 over the real tokens, stay below T)."""
    return length if largest_position is None else largest_position + 1


def prompt_ids_error(*, integer_matrix: bool, found: str, tokens: int | None, bounds: tuple[int, int] | None,
                     vocab_size: int):
    """The error for a prompt that is not integer ids [batch, tokens] in [0, vocab_size), or None.

    Both twins check it at the start of `generate` and in a forward over whole texts (where they check
    `check_positions`). ``found`` describes the input (dtype and shape, or its type); ``tokens`` is T;
    ``bounds`` is (smallest, largest) id when known (None for an empty prompt or a traced one).
    """
    if not integer_matrix:
        return ValueError(f"input_ids: expected an integer tensor [batch, tokens], found {found}")
    if tokens == 0:
        return ValueError(f"input_ids: expected at least one token a row, found {found}")
    if bounds is not None and (bounds[0] < 0 or bounds[1] >= vocab_size):
        return ValueError(
            f"input_ids: expected ids in [0, {vocab_size}) (config.vocab_size), found {bounds[0]}..{bounds[1]}"
        )
    return None


def position_ids_error(*, integer: bool, found: str, shape: tuple | None, input_shape: tuple,
                       smallest: int | None):
    """The error for a whole-text forward's ``position_ids`` that are not integer positions >= 0 of
    shape [B, T] or [1, T] (``input_shape`` = input_ids' (B, T)), or None. ``smallest`` is their
    smallest value when known (None when traced or empty)."""
    batch, length = input_shape
    if not integer or shape is None or len(shape) != 2 or shape[1] != length or shape[0] not in (1, batch):
        expected = f"[{batch}, {length}]" + (f" (or [1, {length}])" if batch != 1 else "")
        return ValueError(f"position_ids: expected an integer tensor {expected} like input_ids, found {found}")
    if smallest is not None and smallest < 0:
        return ValueError(f"position_ids: expected positions >= 0, found {smallest}")
    return None


def walsh_operand_names(*, deploy_numerics: bool) -> tuple[str, ...]:
    """The constant tables the Hadamard MLP's `walsh_transform` reads (`numerics.walsh_matrix`).

    The Kronecker factors ``walsh_a`` [a, a] and ``walsh_b`` [b, b] give two small products instead
    of one [W, W] product; under deploy numerics the matrix ``walsh`` itself, whose order of
    summation the reference's quantisation levels were rounded from.
    """
    return ("walsh",) if deploy_numerics else ("walsh_a", "walsh_b")


__all__ = [
    "NeedleWeightsError",
    "TWIN_HELPERS",
    "attention_rule",
    "attention_window_option",
    "check_positions",
    "positions_taken",
    "embedding_scale",
    "logits_to_keep_option",
    "prompt_ids_error",
    "walsh_operand_names",
]
