"""Compiled decoding over a static cache: the engine behind `NeedleForCausalLM.get_compiled_call`.

`generate` with a static cache and a compile config calls the model through `LayerCompiledCall`:
each decoder layer's one-step program is traced by `torch.export` and compiled by inductor once per
variant, then every layer calls the same program on its own tensors; the engram memory is
``torch.compile``d; the few ops between layers stay eager (see `LayerCompiledCall`). Why this shape
and what it costs: docs/decoding.md and benchmarks/README.md.

Shapes use the axis legend of `specification_needle` (here S is a static cache's length).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin, StaticLayer

from .deploy_numerics import quantize_activations
from .numerics import kv_cache_bits


@dataclass(frozen=True)
class NeedleCompiledParts:
    """Compiled stand-ins for parts of the backbone, run by a compiled decoding step (`get_compiled_call`).

    layers: one callable per decoder layer, taking the layer's arguments (`_CompiledDecoderLayer`).
    engram_memory: ``torch.compile`` of `NeedleModel.engram_memory` (hashes, table rows, projections
    and convolutions of every engram site as one graph instead of ~150 eager ops).
    output_head: hidden [B, T, D] -> float32 logits [B, T, V], as `NeedleForCausalLM.tied_logits`.
    """

    layers: tuple
    engram_memory: Callable
    output_head: Callable


class _StaticKeysInPlace(CacheLayerMixin):
    """A static cache layer's keys and values [B, K, S, H] inside a traced decoding step: `update`
    writes the new ones in place at ``positions`` [T] and returns the whole tensors, as `StaticLayer`."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        self.keys, self.values, self.positions = keys, values, positions
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        return self.keys, self.values

    def lazy_initialization(self, *args):
        raise TypeError("a decoding step's cache view holds allocated keys only")

    # The rest of the layer interface (named differently in transformers 4.57 and 5.x) is not used there.
    get_mask_sizes = get_seq_length = get_max_cache_shape = get_max_length = lazy_initialization


def _static_write_positions(layer: StaticLayer, length: int, cache_position: torch.Tensor) -> torch.Tensor:
    """Where a `StaticLayer` writes the keys of ``length`` new tokens, advancing its count as its
    `update` does: transformers 5.x layers count what they hold (``cumulative_length``), 4.57 layers
    write at ``cache_position``."""
    if not hasattr(layer, "cumulative_length"):
        return cache_position
    positions = torch.arange(length, device=cache_position.device) + layer.cumulative_length
    layer.cumulative_length += length  # in place for a tensor count, as `StaticLayer.update`
    return positions


class _DecoderLayerStep(nn.Module):
    """A decoder layer's decoding step over a static cache as a function of tensors alone:
    ``(lanes, attention_mask, cos, sin, positions, walsh_a, walsh_b, pre_offset, post_offset, keys,
    values, engram_key, engram_value, *parameters) -> lanes``, the keys and values written in place.

    The layer's parameters are inputs (named ``parameter_names``), so the program traced from one
    layer serves every layer of the same structure. A layer without an engram site gets zeros as its
    engram key and value, whose gated sum adds exactly 0 to its input: one program serves it too.
    ``step_type``: the layers' step record (`NeedleStepInputs`, read off the step being run, so this
    module needs nothing of the model's module); ``attention_implementation``: see `NeedleStepInputs`.
    """

    def __init__(self, layer: nn.Module, parameter_names: tuple, *, step_type: type,
                 attention_implementation: Optional[str]):
        super().__init__()
        self.parameter_names = parameter_names
        self.step_type = step_type
        self.attention_implementation = attention_implementation
        self._layer = (layer,)  # not a submodule: the traced program takes its parameters as inputs

    def forward(self, lanes, attention_mask, cos, sin, positions, walsh_a, walsh_b, pre_offset, post_offset, keys,
                values, engram_key, engram_value, *parameters):
        parameters = dict(zip(self.parameter_names, parameters))
        step = self.step_type(key_visible=None, attention_mask=attention_mask, cos=cos, sin=sin,
                              cache_position=positions, walsh=(walsh_a, walsh_b), pre_offsets=None, post_offsets=None,
                              attention_implementation=self.attention_implementation)
        options = dict(cache=_StaticKeysInPlace(keys, values, positions), lane_offsets=(pre_offset, post_offset))
        return torch.func.functional_call(self._layer[0], parameters, (lanes, engram_key, engram_value, step), options)[0]


@dataclass(frozen=True)
class _LayerBinding:
    """What a compiled decoding step reads of one decoder layer: its parameters (named) and the module
    tree they were read from, to notice a replaced module or parameter (a PEFT adapter, say)."""

    names: tuple
    parameters: tuple
    signature: tuple  # (name, shape, dtype) of every parameter: part of a program's key
    # Every submodule and parameter as (the dict that holds it, its key, the object), three tuples.
    holders: tuple
    attributes: tuple
    members: tuple

    @classmethod
    def of(cls, layer: nn.Module) -> "_LayerBinding":
        named = list(layer.named_parameters())
        modules = dict(layer.named_modules())
        slots = [(modules[name.rpartition(".")[0]]._parameters, name.rpartition(".")[2], p) for name, p in named]
        slots += [(parent._modules, attribute, child) for parent in modules.values()
                  for attribute, child in parent._modules.items()]
        holders, attributes, members = zip(*slots)
        return cls(
            names=tuple(name for name, _ in named),
            parameters=tuple(p for _, p in named),
            signature=tuple((name, tuple(p.shape), p.dtype) for name, p in named),
            holders=holders,
            attributes=attributes,
            members=members,
        )

    def current(self) -> bool:
        """Whether the layer still holds these modules and parameters (checked every step, so in C loops)."""
        return all(map(operator.is_, map(dict.get, self.holders, self.attributes), self.members))


class _CompiledDecoderLayer:
    """Decoder layer ``index`` as a compiled decoding step runs it: same arguments as the layer."""

    def __init__(self, call: "LayerCompiledCall", index: int):
        self.call = call
        self.index = index

    def __call__(self, lanes, engram_key, engram_value, step, cache=None, *, lane_offsets,
                 output_attentions: bool = False):
        return self.call.run_layer(self.index, lanes, engram_key, engram_value, step, cache,
                                   lane_offsets=lane_offsets, output_attentions=output_attentions)


# Inductor settings of the decoding-step programs (the caller's ``options`` win): one-row products
# become reductions inductor generates and fuses, reading each weight row once, and the program's
# wrapper is C++ (its buffer allocations and kernel calls cost more in Python). Timings:
# benchmarks/README.md.
DECODING_STEP_INDUCTOR_OPTIONS = {"post_grad_fusion_options": {"decompose_mm_pass": {}}, "cpp_wrapper": True}


def _inductor_settings(options: dict) -> dict:
    """Inductor's settings for a compile config's ``options`` (`CompileConfig.to_dict`):
    `DECODING_STEP_INDUCTOR_OPTIONS`, then its mode's settings, then its own ``options``."""
    from torch._inductor import list_mode_options

    mode = options.get("mode")
    return dict(DECODING_STEP_INDUCTOR_OPTIONS, **(list_mode_options(mode) if mode else {}), **(options.get("options") or {}))


def _compiled_engram_memory(engram_memory: Callable, options: dict) -> Callable:
    """``torch.compile`` of `NeedleModel.engram_memory` as the compile config asks; with inductor, under
    the decoding steps' settings too (its key and value projections of a few rows become reductions,
    ~0.25 ms a step less at the Needle 2 size)."""
    if options.get("backend", "inductor") != "inductor":
        return torch.compile(engram_memory, **options)
    return torch.compile(engram_memory, fullgraph=options.get("fullgraph", False), dynamic=options.get("dynamic"),
                         options=_inductor_settings(options))


class LayerCompiledCall:
    """The model's ``__call__`` for decoding steps over a static cache, its decoder layers and engram
    memory compiled, handed to the forward as ``compiled_parts``.

    Each decoder layer's step is traced once per variant (input shapes, parameter table, numerics
    settings: the program's key) by `torch.export` into a program of tensors alone, the layer's
    parameters among them (`_DecoderLayerStep`), and compiled by inductor straight from that graph (``torch._inductor.compile``, `DECODING_STEP_INDUCTOR_OPTIONS`). Every layer then
    calls the same program on its own tensors with no guard evaluation: dynamo's per-call guards and
    wrappers cost more than a layer's kernels in a one-row step. Another ``backend`` than inductor
    compiles the traced program with ``torch.compile``. The engram memory is ``torch.compile`` of
    `NeedleModel.engram_memory`; the few ops between layers stay eager. A step the programs do not
    cover (gradients on, attention probabilities asked for, flex attention's block masks, a cache that
    is not static) runs the layer modules.
    """

    def __init__(self, model: nn.Module, options: dict):  # a NeedleForCausalLM
        self.model = model
        self.options = options
        backbone = model.model
        self.layers = tuple(_CompiledDecoderLayer(self, index) for index in range(len(backbone.layers)))
        self.engram_memory = _compiled_engram_memory(backbone.engram_memory, options)
        self.programs = {}  # program key -> compiled program
        self._bindings = ()
        self._keyed_step = None
        self._step_key_value = None
        self._zero_engram = None
        self._walsh_factors = ()
        self._head = self._head_made_from = None

    def bindings(self) -> tuple:
        """Each decoder layer's `_LayerBinding`, made again for a layer whose modules changed."""
        layers = self.model.model.layers
        if len(self._bindings) != len(layers):
            self._bindings = tuple(_LayerBinding.of(layer) for layer in layers)
        elif not all(binding.current() for binding in self._bindings):
            self._bindings = tuple(
                binding if binding.current() else _LayerBinding.of(layer) for binding, layer in zip(self._bindings, layers)
            )
        return self._bindings

    def _compiled_program(self, program: _DecoderLayerStep, inputs: list) -> Callable:
        graph = torch.export.export(program, tuple(inputs), strict=False).module()
        # Flat positional inputs: without the pytree code generation, a call does not flatten its ~40
        # arguments through pytree.
        graph.graph._codegen = torch.fx.graph.CodeGen()
        graph.recompile()
        backend = self.options.get("backend", "inductor")
        if backend != "inductor":
            return torch.compile(graph, backend=backend, fullgraph=True, dynamic=False)
        from torch._inductor import compile as inductor_compile

        return inductor_compile(graph, inputs, options=_inductor_settings(self.options))

    def _step_key(self, step) -> tuple:
        """What a program's key takes from the step's shared tensors and the numerics settings, and the
        Walsh matrix's Kronecker factors the programs read instead of it (once per step)."""
        if self._keyed_step is not step:
            config = self.model.config
            tensors = (step.attention_mask, step.cos, step.sin, step.cache_position)
            backbone = self.model.model
            self._walsh_factors = tuple(backbone.constant(name, step.cos.device, step.attention_mask.dtype)
                                        for name in ("walsh_a", "walsh_b"))
            self._keyed_step = step
            self._step_key_value = (
                tuple((tuple(t.shape), t.dtype) for t in tensors),
                config._attn_implementation, config.deploy_numerics, config.act_bits, kv_cache_bits(config),
            )
        return self._step_key_value

    def _zeros(self, lanes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two zero tensors [B, T, D] in the dtype of ``lanes`` [B, T, L, D]: the engram key and value of a
        layer without a site. Two, not one twice: `torch.export` traces inputs that alias each other as one
        input, and a program traced from such a layer would read the key as the value in every layer."""
        batch, length, _, width = lanes.shape
        zeros = self._zero_engram
        if zeros is None or zeros[0].shape != (batch, length, width) or zeros[0].dtype != lanes.dtype \
                or zeros[0].device != lanes.device:
            zeros = self._zero_engram = (lanes.new_zeros(batch, length, width), lanes.new_zeros(batch, length, width))
        return zeros

    def run_layer(self, index, lanes, engram_key, engram_value, step, cache, *, lane_offsets, output_attentions):
        layer = self.model.model.layers[index]
        traceable = (
            not output_attentions
            and not torch.is_grad_enabled()
            and isinstance(cache, StaticLayer)
            and cache.is_initialized
            and isinstance(step.attention_mask, torch.Tensor)
        )
        if not traceable:
            return layer(lanes, engram_key, engram_value, step, cache=cache, lane_offsets=lane_offsets,
                         output_attentions=output_attentions)
        binding = self._bindings[index]
        key = (binding.signature, lanes.shape, lanes.dtype, cache.keys.shape, cache.keys.dtype, self._step_key(step))
        if engram_key is None:
            engram_key, engram_value = self._zeros(lanes)
        positions = _static_write_positions(cache, lanes.shape[1], step.cache_position)
        inputs = [lanes, step.attention_mask, step.cos, step.sin, positions, *self._walsh_factors, *lane_offsets,
                  cache.keys, cache.values, engram_key, engram_value, *binding.parameters]
        program = self.programs.get(key)
        if program is None:
            # sdpa and eager are the same products; one query row over a few hundred keys runs fastest
            # as eager's grouped matrix products (sdpa's CPU kernel expands the keys to every head).
            implementation = "eager" if self.model.config._attn_implementation in ("eager", "sdpa") else None
            traced = _DecoderLayerStep(layer, binding.names, step_type=type(step),
                                       attention_implementation=implementation)
            program = self.programs[key] = self._compiled_program(traced, inputs)
        (lanes,) = program(*inputs)  # flat outputs
        return lanes, None

    def output_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """`NeedleForCausalLM.tied_logits` over a transposed copy of the tied embedding [D, V], made again
        when the embedding changes: a one-row product reads it faster than the [V, D] table."""
        weight = self.model.lm_head.weight
        made_from = self._head_made_from
        if made_from is None or made_from[0] is not weight or made_from[1] != weight._version:
            self._head = weight.detach().float().t().contiguous()
            self._head_made_from = (weight, weight._version)
        return quantize_activations(hidden, self.model.config).float() @ self._head  # deploy numerics hook

    def __call__(self, **inputs):
        self.bindings()
        parts = NeedleCompiledParts(layers=self.layers, engram_memory=self.engram_memory,
                                    output_head=self.output_head)
        return self.model(**inputs, compiled_parts=parts)


__all__ = ["DECODING_STEP_INDUCTOR_OPTIONS", "LayerCompiledCall", "NeedleCompiledParts"]
