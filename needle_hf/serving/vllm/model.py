"""Needle 2 as a native vLLM model: continuous batching, paged KV cache, prefix caching.

The math is the PyTorch twin's (`needle_hf.models.needle.modeling_needle`): the decoder layers *are*
`NeedleDecoderLayer` modules (norms, hyper-connection routing and Sinkhorn, the engram gate, the
Walsh MLP), the engram sites are `NeedleEngram` modules fed by `engram_window_memory`, and the
logits are `tied_logits`. Only three things are vLLM's here:

- attention: `NeedlePagedAttention` keeps the twin's projections, q/k norms, RoPE, output gate and
  deploy-numerics hooks, and hands the rotated q/k/v to vLLM's paged `Attention` (GQA, prefix
  caching, chunked prefill) in place of the twin's cache and attention function;
- batching: vLLM runs every scheduled token of every request as one flat row [N]. The layers are
  position-wise apart from attention, so the twin's modules see it as a batch of one, [1, N, ...];
  the engram, which reads earlier tokens of the same text, is rebuilt per request (below);
- weight loading: the checkpoint's tensor names are the twin's, so they load one to one.

Engram across the flat batch. An engram output at position p reads the tokens p - H .. p of its
own request (H = `NeedleConfig.engram_history`). For each request the model lays out a segment
``[H tokens before the chunk, the chunk's tokens]`` and puts the segments side by side in one
stream; positions before the text are marked hidden, and no output reads more than H positions
back, so no output reads another request's segment. Requests with one new token (decoding) get
windows ``[H tokens, the token]`` of their own instead, as the twin decodes. The H earlier tokens
come from a token store keyed by KV-cache slot: every forward writes its input ids at the slots
vLLM assigns them, and a request's earlier positions are found through its block table, like its
keys and values. That is
exact for prompt and generated tokens, across chunked prefill and for prefix-cache hits (a cached
block's slots hold the tokens that filled it). The model also declares `token_lookback_depth`, so
runners that gather the prompt tokens before each chunk pass them as ``lookback_token_ids``; they
take precedence over the store where given (vLLM 0.32's CPU runner passes none).

Axis letters: N flat tokens of the step, R requests, H engram history, L lanes, d hidden width.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.interfaces import SupportsLoRA
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sequence import IntermediateTensors

from ...models.needle.configuration_needle import NeedleConfig
from ...models.needle.deploy_numerics import quantize_activations, quantize_kv
from ...models.needle.modeling_needle import (
    NeedleAttention,
    NeedleDecoderLayer,
    NeedleEngram,
    NeedleRMSNorm,
    NeedleStepInputs,
    NeedleWeightsError,
    apply_rotary,
    architecture_constant,
    engram_window_memory,
    lane_mean,
    rope_tables,
    tied_logits,
    walsh_operand,
)
from ...models.needle.numerics import TIED_WEIGHTS

# Tensors of the optional heads: vLLM serves next-token logits only.
UNSERVED_PREFIXES = ("mtp.", "contrastive_head.", "confidence_head.")


# The attention projections (the twin's names and shapes, [out, in] weights): vLLM's own linear layers,
# which its LoRA manager wraps with adapters (`--enable-lora`); the fine-tuning adapter targets them.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj")


class NeedlePagedAttention(NeedleAttention):
    """`NeedleAttention` whose scores and values go through vLLM's paged attention (the KV cache
    lives there), with its projections as vLLM `ReplicatedLinear` layers (LoRA-capable); q/k norms,
    RoPE and the output gate are the twin's."""

    def __init__(self, config: NeedleConfig, layer_idx: int, *, vllm_config: VllmConfig, prefix: str):
        super().__init__(config, layer_idx)
        for name in ATTENTION_PROJECTIONS:
            twin = getattr(self, name)
            setattr(self, name, ReplicatedLinear(twin.in_features, twin.out_features, bias=False,
                                                 quant_config=vllm_config.quant_config, prefix=f"{prefix}.{name}",
                                                 return_bias=False))
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, x: torch.Tensor, step: NeedleStepInputs, cache=None, **attention_kwargs):
        """x: [1, N, d] (normed, the flat batch) -> ([1, N, d], None)."""
        if cache is not None or attention_kwargs:
            raise ValueError(
                "vLLM owns the KV cache and the attention kernel: Needle's vLLM attention takes no cache "
                f"and no attention options (got cache={type(cache).__name__}, options={sorted(attention_kwargs)})"
            )
        _, length, _ = x.shape
        # vLLM's linear layers (and their LoRA adapters) take the flat batch as rows: [N, d]
        x = quantize_activations(x, self.config)[0]  # deploy numerics hook, as in the twin
        q = self.q_proj(x).view(1, length, self.num_heads, self.head_dim).transpose(1, 2)  # [1, H, N, hd]
        k = self.k_proj(x).view(1, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, KV, N, hd]
        v = self.v_proj(x).view(1, length, self.num_kv_heads, self.head_dim)  # [1, N, KV, hd]
        q = apply_rotary(self.q_norm(q), step.cos, step.sin)
        k = apply_rotary(self.k_norm(k), step.cos, step.sin)
        k, v = quantize_kv(k, v, self.config)  # deploy numerics hook, as in the twin
        out = self.attn(q[0].transpose(0, 1).reshape(length, -1), k[0].transpose(0, 1).reshape(length, -1),
                        v.reshape(length, -1))
        out = out.view(length, -1) * torch.sigmoid(self.gate_proj(x))  # [N, attention_dim]
        out = quantize_activations(out, self.config)  # deploy numerics hook, as in the twin
        return self.o_proj(out).unsqueeze(0), None


class NeedleSlotTokenStore(nn.Module):
    """Token id of every KV-cache slot vLLM has filled, to find each request's earlier tokens."""

    def __init__(self, block_size: int):
        super().__init__()
        self.block_size = block_size
        self.register_buffer("ids", torch.zeros(0, dtype=torch.int32), persistent=False)
        self._layout_checked = False

    def write(self, slot_mapping: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Record ``input_ids`` [N] at ``slot_mapping`` [N] (negative slots are padding)."""
        if slot_mapping.numel() == 0:
            return
        needed = int(slot_mapping.max()) + 1
        if needed > self.ids.numel():
            grown = torch.zeros(max(needed, 2 * self.ids.numel()), dtype=torch.int32, device=input_ids.device)
            grown[: self.ids.numel()] = self.ids
            self.ids = grown
        real = slot_mapping >= 0
        self.ids[slot_mapping[real].long()] = input_ids[real].to(torch.int32)

    def slots(self, block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """KV slot of ``positions`` (>= 0) of the requests in ``rows``, through their block tables."""
        blocks = block_table[rows, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def check_layout(self, block_table, rows, positions, slot_mapping) -> None:
        """Once: the slots computed from the block table are the ones vLLM assigned the new tokens."""
        assigned = slot_mapping >= 0  # warm-up runs assign no slots (-1)
        if self._layout_checked or not bool(assigned.any()):
            return
        computed = self.slots(block_table, rows[assigned], positions[assigned])
        if not torch.equal(computed, slot_mapping[assigned].long()):
            raise RuntimeError(
                f"Needle's engram token store expected KV slot = block_table[block] * {self.block_size} + offset, "
                "but the attention metadata's slot_mapping disagrees; the engram cannot find earlier tokens "
                "with this attention backend's block layout"
            )
        self._layout_checked = True

    def read(self, block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids [*] at ``positions`` of ``rows`` (0 where a position is negative)."""
        valid = positions >= 0
        slots = self.slots(block_table, rows, positions.clamp(min=0))
        found = self.ids[slots.clamp(max=max(self.ids.numel() - 1, 0))] if self.ids.numel() else torch.zeros_like(slots)
        return torch.where(valid, found.long(), 0)


def merge_lookback(history_ids: torch.Tensor, lookback_token_ids: torch.Tensor) -> torch.Tensor:
    """History [R, H] (positions start - H .. start - 1) with the runner's ids where it has them.

    Column j of ``lookback_token_ids`` [R, H] is position ``start - 1 - j``, -1 where the runner has
    no id (before the text, or a generated token)."""
    given = lookback_token_ids.flip(1).long()
    return torch.where(given >= 0, given, history_ids)


def flat_batch_engram_memory(
    engrams: nn.ModuleList,
    config: NeedleConfig,
    ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    history_ids: Optional[torch.Tensor],
    history_visible: Optional[torch.Tensor],
    *,
    dtype: torch.dtype,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Engram (key, value) [1, N, d] of a flat batch, by the layer that reads them.

    ids: [N] the step's tokens, request r's at ``query_start_loc[r]:query_start_loc[r + 1]``;
    history_ids / history_visible: [R, H] the H tokens before each request's first new one and
    whether each is text (None: no request has any).

    Requests with one new token (decoding) are a batch of windows ``[history, token]`` [R_1, H + 1]
    with one output each, as the twin decodes; the others are segments side by side in one stream
    (`segment_stream_memory`). Decoding steps are most steps, and a window computes the key and the
    convolution at its one new position only, where the stream computes them at every history row.
    """
    if history_ids is None:
        return segment_stream_memory(engrams, config, ids, query_start_loc, None, None, dtype=dtype)
    counts = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    decoding = counts == 1
    if bool(decoding.all()):  # one token per request: the windows are the flat batch, in order
        windows = decoding_window_memory(engrams, config, ids, history_ids, history_visible, dtype=dtype)
        return {layer: (key.view(1, -1, key.shape[-1]), value.view(1, -1, value.shape[-1]))
                for layer, (key, value) in windows.items()}
    if not bool(decoding.any()):
        return segment_stream_memory(engrams, config, ids, query_start_loc, history_ids, history_visible, dtype=dtype)

    decoding_tokens = query_start_loc[:-1][decoding]
    windows = decoding_window_memory(engrams, config, ids[decoding_tokens], history_ids[decoding],
                                     history_visible[decoding], dtype=dtype)
    others = ~decoding
    other_tokens = torch.repeat_interleave(others, counts)  # [N] bool, tokens of the other requests
    other_starts = F.pad(counts[others].cumsum(0), (1, 0))  # [R_others + 1]
    stream = segment_stream_memory(engrams, config, ids[other_tokens], other_starts, history_ids[others],
                                   history_visible[others], dtype=dtype)
    memory = {}
    for layer, (key, value) in stream.items():
        merged = []
        for window_part, stream_part in ((windows[layer][0], key), (windows[layer][1], value)):
            out = stream_part.new_empty(1, ids.shape[0], stream_part.shape[-1])
            out[0, other_tokens] = stream_part[0]
            out[0, decoding_tokens] = window_part[:, 0]
            merged.append(out)
        memory[layer] = tuple(merged)
    return memory


def decoding_window_memory(
    engrams: nn.ModuleList,
    config: NeedleConfig,
    tokens: torch.Tensor,
    history_ids: torch.Tensor,
    history_visible: torch.Tensor,
    *,
    dtype: torch.dtype,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Engram (key, value) [R, 1, d] of one new token per request (tokens [R]), from windows
    ``[history, token]`` [R, H + 1] with one output each (the twin's decoding step)."""
    window_ids = torch.cat([history_ids, tokens[:, None].long()], dim=1)  # [R, H + 1]
    window_visible = F.pad(history_visible, (0, 1), value=True)
    return engram_window_memory(engrams, config, window_ids, window_visible, config.engram_history, dtype)


def segment_stream_memory(
    engrams: nn.ModuleList,
    config: NeedleConfig,
    ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    history_ids: Optional[torch.Tensor],
    history_visible: Optional[torch.Tensor],
    *,
    dtype: torch.dtype,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`flat_batch_engram_memory` of any requests as one stream: request r's segment ``[history,
    new tokens]`` starts at ``query_start_loc[r] + r * H`` (see the module docstring)."""
    depth = config.engram_history
    device = ids.device
    num_requests = query_start_loc.shape[0] - 1
    counts = query_start_loc[1:] - query_start_loc[:-1]
    requests = torch.repeat_interleave(torch.arange(num_requests, device=device), counts)  # [N]
    new_index = torch.arange(ids.shape[0], device=device) + (requests + 1) * depth  # [N]
    segment_starts = query_start_loc[:-1] + torch.arange(num_requests, device=device) * depth  # [R]
    history_index = segment_starts[:, None] + torch.arange(depth, device=device)  # [R, H]
    length = ids.shape[0] + num_requests * depth
    stream_ids = torch.zeros(length, dtype=torch.long, device=device)
    stream_visible = torch.zeros(length, dtype=torch.bool, device=device)
    stream_ids[new_index] = ids
    stream_visible[new_index] = True
    if history_ids is not None:
        stream_ids[history_index] = history_ids
        stream_visible[history_index] = history_visible
    memory = engram_window_memory(engrams, config, stream_ids[None], stream_visible[None], 0, dtype)
    return {layer: (key[:, new_index], value[:, new_index]) for layer, (key, value) in memory.items()}


class NeedleVllmModel(nn.Module):
    """The backbone with the twin's weight names: ``embed_tokens``, ``layers.{i}``, ``norm``, ``engrams.{s}``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: NeedleConfig = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = []
        for i in range(config.num_hidden_layers):
            layer = NeedleDecoderLayer(config, i)
            layer.self_attn = NeedlePagedAttention(
                config, i, vllm_config=vllm_config, prefix=f"{prefix}.layers.{i}.self_attn"
            )
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.norm = NeedleRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.engrams = nn.ModuleList([NeedleEngram(config) for _ in config.engram_layers])
        self.embed_scale = math.sqrt(config.hidden_size)
        self.attention_layer_name = f"{prefix}.layers.0.self_attn.attn"
        self.token_store = NeedleSlotTokenStore(vllm_config.cache_config.block_size)
        for name in ("walsh", "walsh_a", "walsh_b", "rope_inverse_frequencies", "pre_offsets", "post_offsets"):
            dtype = torch.get_default_dtype() if name.startswith("walsh") else torch.float32  # walsh: the compute dtype
            self.register_buffer(name, torch.from_numpy(architecture_constant(name, config)).to(dtype), persistent=False)

    # ----------------------------------------------------------------------------------------------
    # Per-step inputs

    def _attention_metadata(self):
        """This step's attention metadata of the first layer (None on vLLM's warm-up and profile runs)."""
        if not is_forward_context_available():
            return None
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batched steps: not used with this model
            raise NotImplementedError("Needle does not support micro-batched (DBO) steps")
        if isinstance(metadata, dict):
            return metadata.get(self.attention_layer_name)
        return None

    def step_inputs(self, positions: torch.Tensor) -> NeedleStepInputs:
        """RoPE tables of the flat batch's positions, what the Walsh transform reads (`walsh_operand`) and
        the lane offsets. Masks and cache positions are vLLM's (its attention metadata), so those fields stay empty."""
        cos, sin = rope_tables(positions, self.rope_inverse_frequencies)  # [N, hd] each
        return NeedleStepInputs(key_visible=None, attention_mask=None, cos=cos[None, None], sin=sin[None, None],
                                cache_position=None, walsh=walsh_operand(self.config, self.get_buffer),
                                pre_offsets=self.pre_offsets, post_offsets=self.post_offsets)

    def engram_memory(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lookback_token_ids: Optional[torch.Tensor]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Engram (key, value) [1, N, d] of the flat batch's tokens, by the layer that reads them."""
        if not self.engrams:
            return {}
        depth = self.config.engram_history
        device = input_ids.device
        metadata = self._attention_metadata()
        if metadata is None:  # warm-up run: one request, nothing before it
            query_start_loc = torch.tensor([0, input_ids.shape[0]], device=device)
            history_ids = history_visible = None
        else:
            query_start_loc = metadata.query_start_loc.long()
        num_requests = query_start_loc.shape[0] - 1
        counts = query_start_loc[1:] - query_start_loc[:-1]  # [R]
        num_real = int(query_start_loc[-1])  # tokens past this are padding of the step
        requests = torch.repeat_interleave(torch.arange(num_requests, device=device), counts)  # [N_real]
        ids, token_positions = input_ids[:num_real].long(), positions[:num_real].long()

        if metadata is not None:
            store, block_table = self.token_store, metadata.block_table
            chunk_starts = token_positions[query_start_loc[:-1].clamp(max=max(num_real - 1, 0))]  # [R]
            chunk_starts = torch.where(counts > 0, chunk_starts, 0)
            earlier = chunk_starts[:, None] - depth + torch.arange(depth, device=device)  # [R, H]
            rows = torch.arange(num_requests, device=device)[:, None].expand(-1, depth)
            history_ids = store.read(block_table, rows, earlier)
            if lookback_token_ids is not None:
                history_ids = merge_lookback(history_ids, lookback_token_ids[:num_requests])
            history_visible = earlier >= 0
            slot_mapping = metadata.slot_mapping[:num_real]
            store.check_layout(block_table, requests, token_positions, slot_mapping)
            store.write(slot_mapping, ids)

        memory = flat_batch_engram_memory(
            self.engrams, self.config, ids, query_start_loc, history_ids, history_visible,
            dtype=self.embed_tokens.weight.dtype,
        )
        padding = input_ids.shape[0] - num_real
        return {layer: (F.pad(key, (0, 0, 0, padding)), F.pad(value, (0, 0, 0, padding)))
                for layer, (key, value) in memory.items()}

    # ----------------------------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lookback_token_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """input_ids, positions: [N] (the flat batch) -> final-normed hidden states [N, d]."""
        dtype = self.embed_tokens.weight.dtype
        x0 = (self.embed_tokens(input_ids).float() * self.embed_scale).to(dtype)[None]  # [1, N, d]
        memory = self.engram_memory(input_ids, positions, lookback_token_ids)
        step = self.step_inputs(positions)
        lanes = x0[:, :, None, :].expand(-1, -1, self.config.hyper_connection_lanes, -1)  # [1, N, L, d]
        for i, layer in enumerate(self.layers):
            key, value = memory.get(i, (None, None))
            lanes, _ = layer(lanes, key, value, step)
        return self.norm(lane_mean(lanes))[0]


def check_servable(config: NeedleConfig) -> None:
    """Raise ValueError for a config whose forward this model does not compute."""
    if config.attention_window:
        raise ValueError(
            f"NeedleConfig.attention_window={config.attention_window}: Needle's vLLM model attends to the whole "
            "context (vLLM's prefix cache and chunked prefill assume it); serve a config with attention_window=0, "
            "or use the PyTorch model's generate(attention_window=n) for the engine's sliding KV window"
        )


class NeedleForCausalLM(nn.Module, SupportsLoRA):
    """vLLM's Needle 2 text generator (architecture name ``NeedleForCausalLM``, as in config.json).

    LoRA (``--enable-lora``): adapters on the attention projections (`ATTENTION_PROJECTIONS`, one
    weight each in the checkpoint, so nothing is packed), as `needle_hf.finetune` trains them.
    """

    packed_modules_mapping: dict[str, list[str]] = {}
    embedding_modules: dict[str, str] = {}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if not isinstance(config, NeedleConfig):
            raise TypeError(f"NeedleForCausalLM needs a NeedleConfig (model_type needle2), got {type(config).__name__}")
        if vllm_config.parallel_config.tensor_parallel_size > 1 or vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                "Needle (~45M parameters) runs one replica per device: use --data-parallel-size to scale out, "
                "not tensor or pipeline parallelism"
            )
        check_servable(config)
        self.config = config
        self.model = NeedleVllmModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))

    @property
    def token_lookback_depth(self) -> int:
        """Earlier tokens the engram reads (`NeedleConfig.engram_history`)."""
        return self.config.engram_history if self.config.engram_layers else 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.model.embed_tokens(input_ids).float() * self.model.embed_scale).to(self.model.embed_tokens.weight.dtype)

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        intermediate_tensors: Optional[IntermediateTensors] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        lookback_token_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("Needle reads token ids (its engram memory hashes them): prompt embeddings are not supported")
        return self.model(input_ids, positions, lookback_token_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] tied to the token embedding."""
        hidden_states = quantize_activations(hidden_states, self.config)  # deploy numerics hook, as in the twin
        return tied_logits(hidden_states, self.model.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's tensors (the twin's names) one to one; the optional heads are skipped,
        and a tied alias (``lm_head.weight``, if a checkpoint stores it) must equal the embedding."""
        params = dict(self.named_parameters())
        loaded, aliases = set(), {}
        for name, tensor in weights:
            if name.startswith(UNSERVED_PREFIXES):
                continue
            if name in TIED_WEIGHTS:
                aliases[name] = tensor
                continue
            if name not in params:
                raise NeedleWeightsError(f"checkpoint tensor {name} has no counterpart in Needle's vLLM model")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise NeedleWeightsError(
                    f"tensor {name}: expected {tuple(param.shape)}, got {tuple(tensor.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
        for name, tensor in aliases.items():
            source = params[TIED_WEIGHTS[name]]
            if tuple(tensor.shape) != tuple(source.shape) or not torch.equal(tensor.to(source), source):
                raise NeedleWeightsError(
                    f"tensor {name} differs from {TIED_WEIGHTS[name]}: Needle's output head is tied to the token embedding"
                )
        return loaded
