"""The flat-batch engram of needle_hf.serving.vllm equals the PyTorch twin's, request by request (no engine).

A mixed flat batch: a prompt from its start, a chunk in the middle of a text (its history is the
11 tokens before the chunk), decoding steps with fewer and with more earlier tokens than the
history holds; and a batch of decoding steps only (the model's other path). Each request must get
the (key, value) the twin computes for it alone with its cache of earlier tokens; and ids the
runner passes as lookback take the place of store reads.
"""

import pytest

import torch
from transformers import DynamicCache

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.serving.vllm.model import flat_batch_engram_memory, merge_lookback
from vllm_support import perturb_every_parameter

pytestmark = pytest.mark.vllm  # runs in .venv-vllm only

CONFIG = dict(vocab_size=300, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
              engram_layers=(0, 1), engram_slots=128)
# (tokens before the chunk, tokens in the chunk) per request
MIXED = [(0, 9), (4, 1), (23, 7), (30, 1)]
DECODING = [(4, 1), (30, 1), (0, 1)]


def twin_memory(model, text, start, count):
    """The twin's engram of ``text[start:start + count]`` after a cached forward over ``text[:start]``."""
    backbone = model.model
    cache = DynamicCache(config=model.config)

    def memory(ids, first):
        cache_position = torch.arange(ids.shape[0]) + first
        step = backbone.step_inputs(1, ids.shape[0], cache_position, first + ids.shape[0], None, None)
        return backbone.engram_memory(ids[None], step, cache)

    if start:
        memory(text[:start], 0)  # fills the cache's engram state with the ids before the chunk
    return memory(text[start:start + count], start)


@pytest.mark.parametrize("requests", [MIXED, DECODING], ids=["mixed", "decoding"])
def test_flat_batch_engram_equals_the_twin_per_request(requests):
    torch.manual_seed(0)
    config = NeedleConfig(**CONFIG)
    model = NeedleForCausalLM(config).eval()
    perturb_every_parameter(model, seed=3)
    depth = config.engram_history
    texts = [torch.randint(3, config.vocab_size, (start + count,)) for start, count in requests]
    ids = torch.cat([text[start:] for text, (start, _) in zip(texts, requests)])
    query_start_loc = torch.tensor([0, *torch.tensor([c for _, c in requests]).cumsum(0).tolist()])
    earlier = torch.tensor([start for start, _ in requests])[:, None] - depth + torch.arange(depth)  # [R, H]
    history_ids = torch.stack([torch.where(row >= 0, text[row.clamp(min=0)], 0) for text, row in zip(texts, earlier)])

    with torch.no_grad():
        flat = flat_batch_engram_memory(model.model.engrams, config, ids, query_start_loc, history_ids, earlier >= 0,
                                        dtype=torch.float32)
        for r, (text, (start, count)) in enumerate(zip(texts, requests)):
            alone = twin_memory(model, text, start, count)
            rows = slice(int(query_start_loc[r]), int(query_start_loc[r + 1]))
            for layer, (key, value) in alone.items():
                torch.testing.assert_close(flat[layer][0][0, rows], key[0], rtol=0, atol=1e-6)
                torch.testing.assert_close(flat[layer][1][0, rows], value[0], rtol=0, atol=1e-6)

    # The runner's lookback (column j = position start - 1 - j, -1 where it has none) fills the history.
    lookback = torch.where(earlier >= 0, history_ids, -1).flip(1)
    assert torch.equal(merge_lookback(torch.zeros_like(history_ids), lookback), history_ids)
