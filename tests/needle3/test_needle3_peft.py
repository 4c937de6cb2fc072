"""PEFT LoRA on the Needle 3 PyTorch model (no reference needed): adapters on the attention projections
train (the loss falls), save and load back to the same logits, and merge into the base weights."""

from __future__ import annotations

import pytest
import torch

from needle_hf.models.needle3 import Needle3Config

peft = pytest.importorskip("peft")

CONFIG = dict(vocab_size=120, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              head_dim=8, value_head_dim=8, sliding_window=3, global_layers=[1], engram_layers=[0], engram_slots=31,
              hyper_connection_lanes=2, out_vocab=100)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]


def perturbed_base():
    """A `Needle3ForCausalLM` with every parameter moved off its initial value (seeded): at the reference
    initialisation some gates are shut, and the attention path would carry no gradient."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Needle3Config(**CONFIG))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.add_(torch.randn_like(parameter) * (0.05 if "embed" in name or "tables" in name else 0.2))
    return model


def test_lora_trains_saves_and_merges(tmp_path, one_cpu_thread):
    base = perturbed_base()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    ids = torch.randint(3, 100, (2, 12))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids, use_cache=False).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(perturbed_base(), tmp_path / "adapter")
    merged = model.merge_and_unload()
    with torch.no_grad():
        assert (merged(input_ids=ids, use_cache=False).logits - adapted).abs().max().item() <= 1e-5
        assert (reloaded.eval()(input_ids=ids, use_cache=False).logits - adapted).abs().max().item() <= 1e-5
