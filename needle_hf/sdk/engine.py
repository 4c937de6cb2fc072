"""One answer step of a tool-calling conversation on either twin: prompt ids in, answer tokens and signals out.

`load_backend` gives a `TorchBackend` (`NeedleForCausalLM`) or a `FlaxBackend`
(`FlaxNeedleForCausalLM`); both offer the same four operations on token ids:

  - `generate(rows, max_new_tokens=, tools=)`: greedy answers of a batch of prompts (lists of
    ids, left-padded here), grammar-constrained to ``tools`` when the backend has a grammar. Each
    `Generation` holds the new ids (EOS excluded), the probability of each chosen token under the
    distribution the decoder picked from (after the grammar's mask), whether EOS was reached, and
    the prefill and decode wall times.
  - `confidence(rows)`: the confidence head's probability per row (prompt + answer ids).
  - `embed(texts)`: the contrastive head's unit embeddings [N, C] and its temperature.
  - `count(text)`: token count of a text without special tokens.

Greedy decoding on both. PyTorch: a plain loop over the model's cache (the prompt once, then one
token a forward, the grammar's mask applied to each step's logits), on ``cpu_threads`` threads; with
a confidence head each forward also returns its hidden states, so the head is read without running
the prompt again. With ``compile=True`` the same loop over a static cache, its steps through the
model's compiled layer programs. Flax: a loop of two compiled functions, the prefill and one cached decoding step, with
the grammar's mask applied on the host between steps, the confidence head read off the steps' cells
as on PyTorch.
Prompts are left-padded to a multiple of 64 tokens on Flax, and the caches of compiled steps (Flax,
PyTorch with ``compile=True``) to one of 256, so a conversation compiles few shapes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

FRAMEWORKS = ("pt", "flax")
# Shapes are rounded up so that a conversation compiles few programs: Flax prompts to a multiple of
# _PROMPT_BUCKET tokens, caches of compiled steps (Flax, PyTorch with compile=True) to one of _CACHE_BUCKET.
_PROMPT_BUCKET = 64
_CACHE_BUCKET = 256


def _rounded_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


@dataclasses.dataclass
class Generation:
    """One generated answer.

    Attributes:
        ids: the answer's token ids, EOS excluded.
        token_probs: [len(ids)] probability of each chosen token.
        finished: EOS was generated (False: cut at max_new_tokens).
        prefill_seconds, decode_seconds: wall time until the first new token's logits, and after it.
        confidence: the confidence head's probability of prompt + answer, when the backend read it
            while decoding (a finished answer of a model with the head); None: not read.
    """

    ids: list
    token_probs: list
    finished: bool
    prefill_seconds: float
    decode_seconds: float
    confidence: Optional[float] = None


def _grammar_for(tokenizer, vocab_size: int, *, enabled: bool):
    if not enabled:
        return None
    try:
        from ..generation.grammar import ToolCallGrammar

        return ToolCallGrammar(tokenizer, vocab_size=vocab_size)
    except ImportError:  # the [grammar] extra is not installed: decode unconstrained
        return None


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    weights = np.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


class _Backend:
    framework: str

    def __init__(self, model, tokenizer, *, grammar: bool):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.grammar = _grammar_for(tokenizer, self.config.vocab_size, enabled=grammar)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._needle3 = getattr(self.config, "model_type", None) == "needle3"

    @property
    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def has_confidence_head(self) -> bool:
        return bool(getattr(self.config, "use_confidence_head", False))

    @property
    def has_contrastive_head(self) -> bool:
        return bool(getattr(self.config, "use_contrastive_head", False))

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _left_padded(self, rows: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for row, tokens in enumerate(rows):
            ids[row, width - len(tokens):] = tokens
            mask[row, width - len(tokens):] = 1
        return ids, mask

    def _processor(self, tools):
        if self.grammar is None or tools is None:
            return None
        from ..generation.grammar import ToolCallLogitsProcessor

        return ToolCallLogitsProcessor(self.grammar, tools)


class TorchBackend(_Backend):
    """`NeedleForCausalLM` (eval mode, no gradients)."""

    framework = "pt"

    def __init__(self, model, tokenizer, *, grammar: bool, compile: bool = False, cpu_threads: int = 1):
        super().__init__(model.eval(), tokenizer, grammar=grammar)
        self.compile = compile
        self.cpu_threads = cpu_threads

    def generate(self, rows, *, max_new_tokens: int, tools=None) -> list[Generation]:
        if self._needle3:  # Needle 3's forward has its own cache and no position_ids
            return self._generate_with_generate(rows, max_new_tokens=max_new_tokens, tools=tools,
                                                compiled=self.compile)
        return self._generate_greedy(rows, max_new_tokens=max_new_tokens, tools=tools)

    def _generate_greedy(self, rows, *, max_new_tokens: int, tools=None) -> list[Generation]:
        """Greedy decoding with the model's cache in a plain loop: the prompt once, then one token a
        forward, positions and masks as `generate()` builds them (so the same tokens). With a
        confidence head every forward also returns its hidden states, and the head reads them after
        the answer, so the prompt is not run a second time.

        With ``compile``: a static cache, its length rounded up to a multiple of
        `_CACHE_BUCKET` (the step programs compile once per cache length), and every step after
        the prompt through the model's compiled decoding call (`get_compiled_call`, as `generate()`
        with a static cache and a compile config runs it)."""
        import torch
        from transformers import CompileConfig, DynamicCache, StaticCache

        from ..models.needle.generation_needle import torch_threads

        ids, mask = self._left_padded(rows, max(len(r) for r in rows))
        batch, width = ids.shape
        device = self.model.device
        processor = self._processor(tools)
        cells = self.has_confidence_head
        sequences = torch.from_numpy(ids).to(device)  # [B, T + generated]
        attention = torch.from_numpy(mask).to(device)
        positions = attention.cumsum(-1) - 1
        positions.masked_fill_(attention == 0, 1)
        step_forward = self.model
        if self.compile:
            length = max(width + max_new_tokens, min(_rounded_up(width + max_new_tokens, _CACHE_BUCKET),
                                                     self.max_positions))
            cache = StaticCache(config=self.config, max_cache_len=length)
            step_forward = self.model.get_compiled_call(CompileConfig(fullgraph=True, dynamic=False, mode="default"))
        else:
            cache = DynamicCache(config=self.config)
        fed_cells, fed_keep = [], [attention.bool()]  # per forward: cells [B, S, L + 1, d], kept [B, S]
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        new, probs = [], []  # per step: [B] token, [B] its probability
        tokens, step_positions = sequences, positions
        prefill = None
        start = time.perf_counter()
        with torch.no_grad(), torch_threads(self.cpu_threads if device.type == "cpu" else None):
            for step in range(max_new_tokens):
                forward = self.model if step == 0 else step_forward  # the prompt runs eagerly, as in generate()
                out = forward(input_ids=tokens, attention_mask=attention, position_ids=step_positions, cache=cache,
                              use_cache=True, output_hidden_states=cells, logits_to_keep=1, return_dict=True)
                if cells:
                    fed_cells.append(self.model.cells_from_hidden_states(tokens, out.hidden_states))
                scores = out.logits[:, -1].float()  # [B, V]
                if prefill is None:
                    prefill = time.perf_counter() - start
                if processor is not None:
                    scores = processor(sequences, scores)
                distribution = torch.softmax(scores, dim=-1)
                chosen = torch.argmax(scores, dim=-1)
                chosen = torch.where(unfinished, chosen, torch.full_like(chosen, self.pad_token_id))
                new.append(chosen)
                probs.append(distribution.gather(1, chosen[:, None])[:, 0])
                sequences = torch.cat([sequences, chosen[:, None]], dim=-1)
                unfinished = unfinished & (chosen != self.eos_token_id)
                if not bool(unfinished.any()) or step + 1 == max_new_tokens:
                    break
                fed_keep.append(unfinished[:, None])  # the next forward feeds this token: part of the answer
                tokens = chosen[:, None]
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
                step_positions = step_positions[:, -1:] + 1
            end = time.perf_counter()
            new_ids = torch.stack(new, dim=1).cpu().numpy()  # [B, N]
            new_probs = torch.stack(probs, dim=1).cpu().numpy()  # [B, N]
            head = None
            if cells:
                logit = self.model.confidence_head(torch.cat(fed_cells, dim=1), torch.cat(fed_keep, dim=1),
                                                   self.model.model.embed_tokens.weight.dtype)
                head = torch.sigmoid(logit.float()).cpu().tolist()
        prefill = end - start if prefill is None else prefill
        return [self._generation(new_ids[row], new_probs[row], prefill, end - start - prefill, by_token=False,
                                 confidence=None if head is None else head[row]) for row in range(batch)]

    def _generate_with_generate(self, rows, *, max_new_tokens: int, tools=None, compiled: bool) -> list[Generation]:
        """`generate()`; when ``compiled``, with a static cache and the project's compiled decoding (one
        compiled program per layer variant). A logits processor notes when the prefill's logits arrive."""
        import torch
        from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

        from ..models.needle.generation_needle import torch_threads

        clock: list[float] = []

        class _Clock(LogitsProcessor):
            def __call__(self, input_ids, scores):
                clock.append(time.perf_counter())
                return scores

        ids, mask = self._left_padded(rows, max(len(r) for r in rows))
        device = self.model.device
        processors = [p for p in (self._processor(tools),) if p is not None] + [_Clock()]
        options = {"cache_implementation": "static",
                   "compile_config": CompileConfig(fullgraph=True, dynamic=False, mode="default")} if compiled else {}
        start = time.perf_counter()
        with torch.no_grad(), torch_threads(self.cpu_threads if device.type == "cpu" else None):
            out = self.model.generate(
                input_ids=torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(mask).to(device),
                max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                logits_processor=LogitsProcessorList(processors),
                return_dict_in_generate=True, output_scores=True, eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id, **options)
        end = time.perf_counter()
        new = out.sequences[:, ids.shape[1]:].cpu().numpy()  # [B, N]
        probs = np.stack([torch.softmax(s.float(), dim=-1).cpu().numpy() for s in out.scores], axis=1)  # [B, N, V]
        prefill = (clock[0] if clock else end) - start
        return [self._generation(new[row], probs[row], prefill, end - start - prefill, by_token=True)
                for row in range(len(rows))]

    def _generation(self, new, probs, prefill, decode, *, by_token: bool, confidence=None) -> Generation:
        """new: [N] ids; probs: [N] the chosen tokens' probabilities, or [N, V] distributions (``by_token``)."""
        tokens, token_probs, finished = [], [], False
        for step, token in enumerate(new.tolist()):
            if token == self.eos_token_id:
                finished = True
                break
            tokens.append(token)
            token_probs.append(float(probs[step, token] if by_token else probs[step]))
        return Generation(tokens, token_probs, finished, prefill, decode, confidence if finished else None)

    def confidence(self, rows) -> list[float]:
        import torch

        ids, mask = self._left_padded(rows, max(len(r) for r in rows))
        if self._needle3:  # Needle 3's heads read pad_token_id as padding themselves (as the reference does)
            with torch.no_grad():
                return torch.sigmoid(self.model.confidence(torch.from_numpy(ids).to(self.model.device))).tolist()
        with torch.no_grad():
            logit = self.model.confidence_logit(torch.from_numpy(ids).to(self.model.device),
                                                attention_mask=torch.from_numpy(mask).to(self.model.device))
        return torch.sigmoid(logit.float()).cpu().tolist()

    def embed(self, texts) -> tuple[np.ndarray, float]:
        import torch

        rows = [self.tokenizer(text)["input_ids"] for text in texts]
        ids, mask = self._left_padded(rows, max(len(r) for r in rows))
        device = self.model.device
        with torch.no_grad():
            embedding, log_temperature = self.model.contrastive_embedding(
                torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(mask).to(device))
        return embedding.float().cpu().numpy(), float(torch.exp(log_temperature.float()))


class FlaxBackend(_Backend):
    """`FlaxNeedleForCausalLM`: a compiled prefill and a compiled decoding step, looped on the host."""

    framework = "flax"

    def __init__(self, model, tokenizer, *, grammar: bool):
        import jax
        import jax.numpy as jnp

        from ..models.needle.modeling_flax_needle import with_decoding_kernels

        super().__init__(model, tokenizer, grammar=grammar)
        self._params = with_decoding_kernels(model.params, model.config)
        self._empty = (None, None)  # (batch, cache length), the empty cache of that shape

        cells = self.has_confidence_head

        def step(params, ids, mask, positions, cache):
            """-> (last logits [B, V] float32, cache, cells [B, T, L + 1, D] of the fed tokens or None)."""
            out = model(ids, attention_mask=mask, position_ids=positions, params=params, past_key_values=cache,
                        output_hidden_states=cells, logits_to_keep=1)
            fed = jnp.stack(out.hidden_states, axis=2) if cells else None  # x0 and each layer's lane mean
            return out.logits[:, -1].astype("float32"), out.past_key_values, fed

        self._prefill_step = jax.jit(step)
        # A decoding step hands its cache over (donates it): XLA then writes the new keys into the same
        # buffers instead of copying every layer's cache into fresh ones each token (~42 MB at the `base`
        # geometry and a 768-slot cache). The prefill step does not: its input is the kept empty cache.
        self._decoding_step = jax.jit(step, donate_argnums=(4,))
        self._confidence = jax.jit(lambda params, ids, mask: model.confidence_logit(ids, mask, params=params))
        self._confidence_of_cells = jax.jit(lambda params, cells, keep: model.module.apply(
            {"params": params}, cells, keep, method=_confidence_head_of_cells))
        self._embed = jax.jit(lambda params, ids, mask: model.contrastive_embedding(ids, mask, params=params))

    def _empty_cache(self, batch: int, total: int) -> dict:
        """`init_cache(batch, total)`, kept for the next call of the same shape: making it traces the
        whole model (seconds), and a step never changes it (jax arrays are immutable)."""
        if self._empty[0] != (batch, total):
            self._empty = ((batch, total), self.model.init_cache(batch, total))
        return self._empty[1]

    def _padded_to_bucket(self, rows):
        width = _rounded_up(max(len(r) for r in rows), _PROMPT_BUCKET)
        return self._left_padded(rows, width)

    def generate(self, rows, *, max_new_tokens: int, tools=None) -> list[Generation]:
        """Greedy answers; with a confidence head each step also returns the cells of the tokens it fed,
        and the head reads them after the answer (as on PyTorch), so the prompt is not run again."""
        import jax.numpy as jnp

        ids, mask = self._padded_to_bucket(rows)
        batch, width = ids.shape
        # The cache length is rounded up too: the decoding step compiles once per cache length.
        total = _rounded_up(width + max_new_tokens, _CACHE_BUCKET)
        processor = self._processor(tools)
        cache = self._empty_cache(batch, total)
        full_mask = np.ones((batch, total), dtype=np.int32)
        full_mask[:, :width] = mask
        positions = np.clip(np.cumsum(mask, axis=-1) - 1, 0, None).astype(np.int32)
        next_position = positions[:, -1:] + 1
        sequences = ids.copy()
        done = np.zeros(batch, dtype=bool)
        new, probs = [[] for _ in range(batch)], [[] for _ in range(batch)]
        finished = np.zeros(batch, dtype=bool)
        fed_cells, fed_keep = [], [mask.astype(bool)]  # per forward: cells [B, S, L + 1, D], kept [B, S]
        start = time.perf_counter()
        logits, cache, cells = self._prefill_step(self._params, jnp.asarray(ids, jnp.int32), jnp.asarray(full_mask),
                                                  jnp.asarray(positions), cache)
        fed_cells.append(cells)
        prefill = None
        for _ in range(max_new_tokens):
            scores = np.asarray(logits)
            if prefill is None:
                prefill = time.perf_counter() - start
            if processor is not None:
                allowed = processor.masks(sequences)
                scores = np.where(allowed[:, : scores.shape[-1]], scores, -np.inf)
            distribution = _softmax(scores)
            chosen = distribution.argmax(axis=-1)
            for row in range(batch):
                if done[row]:
                    chosen[row] = self.pad_token_id
                    continue
                token = int(chosen[row])
                if token == self.eos_token_id:
                    done[row] = finished[row] = True
                    continue
                new[row].append(token)
                probs[row].append(float(distribution[row, token]))
                if len(new[row]) >= max_new_tokens:
                    done[row] = True
            sequences = np.concatenate([sequences, chosen[:, None].astype(sequences.dtype)], axis=1)
            if done.all():
                break
            fed_keep.append(~done[:, None])  # the next forward feeds this token: part of the answer
            logits, cache, cells = self._decoding_step(self._params, jnp.asarray(chosen[:, None], jnp.int32),
                                                       jnp.asarray(full_mask), jnp.asarray(next_position), cache)
            fed_cells.append(cells)
            next_position = next_position + 1
        end = time.perf_counter()
        prefill = end - start if prefill is None else prefill
        decode = end - start - prefill
        head = [None] * batch
        if self.has_confidence_head and finished.any():
            head = self._head_of_cells(fed_cells, np.concatenate(fed_keep, axis=1), total)
        return [Generation(new[row], probs[row], bool(finished[row]), prefill, decode,
                           head[row] if finished[row] else None) for row in range(batch)]

    def _head_of_cells(self, fed_cells, keep: np.ndarray, total: int) -> list[float]:
        """The confidence head's probability per row from the cells [B, S, L + 1, D] of every fed token
        and their keep mask [B, S], padded to ``total`` positions (the cache length: one compiled head
        per cache length)."""
        import jax.numpy as jnp

        cells = jnp.concatenate(fed_cells, axis=1)
        width = max(total, cells.shape[1])
        cells = jnp.pad(cells, ((0, 0), (0, width - cells.shape[1]), (0, 0), (0, 0)))
        keep = np.pad(keep, ((0, 0), (0, width - keep.shape[1])))
        logit = np.asarray(self._confidence_of_cells(self.model.params, cells, jnp.asarray(keep)), np.float32)
        return (1.0 / (1.0 + np.exp(-logit))).tolist()

    def confidence(self, rows) -> list[float]:
        ids, mask = self._padded_to_bucket(rows)
        logit = np.asarray(self._confidence(self.model.params, ids.astype(np.int32), mask.astype(np.int32)), np.float32)
        return (1.0 / (1.0 + np.exp(-logit))).tolist()

    def embed(self, texts) -> tuple[np.ndarray, float]:
        rows = [self.tokenizer(text)["input_ids"] for text in texts]
        ids, mask = self._padded_to_bucket(rows)
        embedding, log_temperature = self._embed(self.model.params, ids.astype(np.int32), mask.astype(np.int32))
        return np.asarray(embedding, np.float32), float(np.exp(np.asarray(log_temperature, np.float32)))


def _confidence_head_of_cells(module, cells, keep):
    """`FlaxNeedleForCausalLMModule` method: the confidence logit [B] of cells [B, S, L + 1, D] and keep [B, S]."""
    return module.confidence_head(cells, keep)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def folder_tokenizer(source: str, *, max_positions: int):
    """The tokenizer of the folder or Hub id ``source`` (`AutoTokenizer.from_pretrained`).

    A local folder whose only tokenizer file is a SentencePiece ``tokenizer.model`` (how the reference
    ships its tokenizer, and the smart-home demo's weights folder) loads as `NeedleTokenizerFast`,
    built from that file, ``max_positions`` tokens at most; a folder with no tokenizer at all is refused.
    """
    from transformers import AutoTokenizer

    folder = Path(source)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        if not (folder / "tokenizer.model").is_file():
            raise ValueError(f"{folder}: no tokenizer: expected {' + '.join(TOKENIZER_FILES)} or a SentencePiece "
                             f"tokenizer.model, found neither; pass tokenizer=")
        return AutoTokenizer.from_pretrained(source, model_max_length=max_positions)
    return AutoTokenizer.from_pretrained(source)


def _checked_source(source: str, *, argument: str) -> str:
    """``source`` if it is a folder (for ``argument="model"``, one with a config.json) or reads as a Hub
    id (huggingface_hub's `validate_repo_id`); else an error naming ``argument`` that says what it is."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = Path(source).expanduser()
    if path.is_dir():
        if argument == "model" and not (path / "config.json").is_file():
            raise ValueError(f"model: {source} has no config.json: expected a converted Needle folder "
                             "(`needle-hf convert` makes one from a native .pkl or .cact)")
        return str(path)
    if path.exists():
        expected = ("a converted Needle folder (config.json and weights) or a Hub id; a native .pkl or .cact "
                    "converts with `needle-hf convert`") if argument == "model" else "a folder or a Hub id"
        raise ValueError(f"{argument}: {source} is a file, expected {expected}")
    try:
        validate_repo_id(source)
    except HFValidationError:
        raise FileNotFoundError(f"{argument}: no folder at {source}, and it is not a Hub id ('name' or "
                                "'owner/name')") from None
    return source


def load_backend(model, *, framework: Optional[str] = None, tokenizer=None, grammar: bool = True,
                 compile: bool = False, device=None, cpu_threads: int = 1):
    """A backend for ``model``: a folder, a Hub id, or a loaded `NeedleForCausalLM` / `FlaxNeedleForCausalLM`.

    Args:
        framework: "pt" or "flax"; None: "pt" for a name, the model's own for a loaded model.
        tokenizer: a tokenizer, or a folder or Hub id holding one (`folder_tokenizer`); default: the
            model folder's (of a loaded model's ``name_or_path``).
        grammar: constrain answers with `needle_hf.generation.grammar` (when llguidance is installed).
        compile: PyTorch only: decode with a static cache and compiled layer programs (README, "Fast
            decoding"); the first call compiles.
        device: PyTorch only: where to put a model loaded here (default CPU).
        cpu_threads: PyTorch on the CPU: torch's intra-op thread count while answering (put back
            afterwards). One by default: a call is thousands of small ops, and with several OpenMP
            threads each waits for every thread to be scheduled, which on a busy machine made the
            whole call 5-10x slower than one thread (benchmarks/README.md).
    """
    import needle_hf  # noqa: F401  (registers the Auto classes)

    if framework is not None and framework not in FRAMEWORKS:
        raise ValueError(f"framework: expected one of {FRAMEWORKS}, got {framework!r}")
    if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1:
        raise ValueError(f"cpu_threads: expected a positive int, got {cpu_threads!r}")
    for name, flag in (("grammar", grammar), ("compile", compile)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected True or False, got {flag!r}")
    if not isinstance(model, (str, os.PathLike)) and not hasattr(getattr(model, "config", None), "model_type"):
        raise TypeError(f"model: expected a converted Needle folder, a Hub id or a loaded Needle model, got "
                        f"{type(model).__name__}: {model!r:.80}")
    if isinstance(model, (str, os.PathLike)):
        source = _checked_source(os.fspath(model), argument="model")
        framework = framework or "pt"
        if framework == "pt":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(source, torch_dtype="float32")
            if device is not None:
                try:
                    model = model.to(device)
                except RuntimeError as error:
                    raise ValueError(f"device: {error}") from None
        else:
            from transformers import FlaxAutoModelForCausalLM

            model = FlaxAutoModelForCausalLM.from_pretrained(source)
    else:
        source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        own = "flax" if type(model).__name__.startswith("Flax") else "pt"
        if framework is not None and framework != own:
            raise ValueError(f"framework={framework!r} given with a {type(model).__name__} (a {own!r} model)")
        framework = own
    from ..models.needle.configuration_needle import NeedleConfig
    from ..models.needle3.configuration_needle3 import Needle3Config

    if isinstance(model.config, Needle3Config):
        if framework != "pt":
            raise ValueError("framework='flax': the SDK runs Needle 3 with the PyTorch model (framework='pt')")
    elif not isinstance(model.config, NeedleConfig):
        raise ValueError(f"model: expected a Needle model (a NeedleConfig or Needle3Config), got a "
                         f"{type(model.config).__name__}")
    if tokenizer is None:
        if not source:
            raise ValueError("tokenizer: the model has no folder to read its tokenizer from; pass tokenizer=")
        tokenizer = folder_tokenizer(source, max_positions=model.config.max_position_embeddings)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = folder_tokenizer(_checked_source(os.fspath(tokenizer), argument="tokenizer"),
                                     max_positions=model.config.max_position_embeddings)
    elif not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(f"tokenizer: expected a tokenizer, or a folder or Hub id holding one, got "
                        f"{type(tokenizer).__name__}: {tokenizer!r:.80}")
    if framework == "pt":
        return TorchBackend(model, tokenizer, grammar=grammar, compile=compile, cpu_threads=cpu_threads)
    if compile:
        raise ValueError("compile=True is for framework='pt' (the Flax backend compiles its steps always)")
    return FlaxBackend(model, tokenizer, grammar=grammar)


__all__ = ["FRAMEWORKS", "FlaxBackend", "Generation", "TorchBackend", "folder_tokenizer", "load_backend"]
