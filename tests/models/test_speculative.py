"""Decoding with drafts: MTP self-speculation (`generate(use_mtp_head=True)`) and prompt lookup.

Both must write exactly the tokens of plain greedy decoding, and MTP sampling must keep the plain
sampling distribution. A random MTP head drafts badly (every
draft rejected), so the MTP tests also set the head to copy the last token (`_copying_mtp`): real
weights whose drafts hold exactly where the text repeats a token, which makes both paths run
(two tokens kept; draft rejected and its cache entry cropped), alone and interleaved.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from needle_reference import TINY_NATIVE_CONFIG, make_native_params
from demo_support import demo_folder  # noqa: F401  (fixture: the demo as a HF folder)
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, TopKLogitsWarper

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.models.needle.modeling_needle import NeedleForCausalLM
from needle_hf.models.needle.weight_names import native_to_hf

PROMPT = 20
NEW_TOKENS = 40
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=NEW_TOKENS)


pytestmark = [pytest.mark.v5, pytest.mark.usefixtures("one_cpu_thread")]


def _copying_mtp(model: NeedleForCausalLM) -> NeedleForCausalLM:
    """Set the MTP head to draft the last token again: combine = the normed next-token embedding,
    the block adds nothing, unit norm gains, so its logits are E @ E[t+1], whose argmax is t+1."""
    d = model.config.hidden_size
    with torch.no_grad():
        model.mtp.combine_proj.weight.zero_()
        model.mtp.combine_proj.weight[:, d:] = torch.eye(d)
        for norm in (model.mtp.embed_norm, model.mtp.norm):
            norm.weight.zero_()
        model.mtp.block.self_attn.o_proj.weight.zero_()
        model.mtp.block.mlp.diag_out.zero_()
    return model


def _model(seed: int, *, copying_mtp: bool) -> NeedleForCausalLM:
    native = dict(TINY_NATIVE_CONFIG)
    config = NeedleConfig.from_needle_config(native)
    model = NeedleForCausalLM(config)
    state = {k: torch.from_numpy(v) for k, v in native_to_hf(make_native_params(native, seed, with_heads=False),
                                                                 config).items()}
    model.load_state_dict(state, strict=True)
    return (_copying_mtp(model) if copying_mtp else model).eval()


def _left_padded_batch():
    ids = torch.from_numpy(np.random.default_rng(0).integers(14, TINY_NATIVE_CONFIG["vocab_size"], (3, PROMPT)))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :11] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("copying_mtp", [False, True], ids=["every-draft-rejected", "every-draft-accepted"])
@pytest.mark.parametrize("batch", [1, 3])
def test_mtp_speculation_writes_the_greedy_tokens(batch, copying_mtp):
    # The random tiny model repeats one token: the copying head's drafts all hold, a random head's all fail.
    model = _model(seed=1, copying_mtp=copying_mtp)
    ids, mask = _left_padded_batch()
    ids, mask = ids[:batch], mask[:batch]
    plain = model.generate(ids, attention_mask=mask, **GREEDY)
    out = model.generate(ids, attention_mask=mask, use_mtp_head=True, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, plain)
    assert out.drafted > 0
    if copying_mtp:
        assert out.accepted == out.drafted and out.forwards <= NEW_TOKENS // 2
    else:
        assert out.accepted == 0


def _demo_inputs(tokenizer, queries):
    tools = [{"name": "set_alarm", "description": "Set an alarm.",
              "parameters": {"type": "object", "properties": {"time": {"type": "string"}}, "required": ["time"]}}]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tools=tools, add_generation_prompt=True,
                                           tokenize=False) for q in queries]
    return tokenizer(texts, return_tensors="pt", add_special_tokens=False, padding=True)


def test_mtp_speculation_after_rejections_and_acceptances_on_the_demo(demo_folder):  # noqa: F811
    # The demo answers "11:11" with the tokens "1", "1": the copying head's draft holds there and
    # fails elsewhere, so rejections (cache cropped, engram context from the verified ids) and
    # acceptances alternate in one answer.
    model = _copying_mtp(AutoModelForCausalLM.from_pretrained(demo_folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_folder)
    inputs = _demo_inputs(tokenizer, ["Wake me up at 11:11 tomorrow."])
    plain = model.generate(**inputs, do_sample=False, max_new_tokens=48)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=48, use_mtp_head=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert 0 < out.accepted < out.drafted
    batch = _demo_inputs(tokenizer, ["Wake me up at 11:11 tomorrow.", "Alarm at 7:00 please.", "Set an alarm for 22:22."])
    assert torch.equal(model.generate(**batch, do_sample=False, max_new_tokens=48, use_mtp_head=True),
                       model.generate(**batch, do_sample=False, max_new_tokens=48))


def test_mtp_speculation_stops_at_eos_and_pads_like_generate():
    model = _model(seed=1, copying_mtp=True)
    ids, mask = _left_padded_batch()
    plain = model.generate(ids, attention_mask=mask, **GREEDY)
    eos = int(plain[0, PROMPT + 7])  # a token row 0 writes: it ends row 0 there (and maybe others)
    options = {**GREEDY, "eos_token_id": eos}
    expected = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(model.generate(ids, attention_mask=mask, use_mtp_head=True, **options), expected)


def test_mtp_speculation_with_the_attention_window():
    model = _model(seed=2, copying_mtp=True)
    ids, mask = _left_padded_batch()
    options = {**GREEDY, "attention_window": 16}
    assert torch.equal(model.generate(ids, attention_mask=mask, use_mtp_head=True, **options),
                       model.generate(ids, attention_mask=mask, **options))


def test_mtp_speculation_refuses_what_it_would_ignore():
    model = _model(seed=1, copying_mtp=False)
    ids, mask = _left_padded_batch()
    with pytest.raises(ValueError, match="num_beams must be 1"):
        model.generate(ids, use_mtp_head=True, num_beams=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="does not take logits_processor"):
        model.generate(ids, use_mtp_head=True, logits_processor=LogitsProcessorList([TopKLogitsWarper(2)]), max_new_tokens=4)


SAMPLING = dict(do_sample=True, top_k=4, temperature=0.8, eos_token_id=None, pad_token_id=0)


def _joint_counts(*samples: torch.Tensor) -> np.ndarray:
    """Counts [len(samples), cells] of each distinct row of tokens; cells seen fewer than 10 times in
    all pooled into one, so a chi-square test applies."""
    cells: dict = {}
    for row in torch.cat(samples).tolist():
        cells.setdefault(tuple(row), len(cells))
    counts = np.zeros((len(samples), len(cells)))
    for i, sample in enumerate(samples):
        for row in sample.tolist():
            counts[i, cells[tuple(row)]] += 1
    frequent = counts.sum(0) >= 10
    return np.concatenate([counts[:, frequent], counts[:, ~frequent].sum(1, keepdims=True)], axis=1)


def test_mtp_sampling_keeps_the_sampling_distribution():
    # 2000 rows of one 3-token prompt, 4 new tokens each: the first from the prompt's forward, the next
    # two through a draft each (kept with probability min(1, p/q), else drawn from the residual; the
    # copying head's drafts are kept in some rows and rejected in others), the last plainly. The joint
    # distribution of the 4 tokens must be that of plain sampling. (Drawing rejections from p instead of
    # the residual fails this test with a p-value of about 1e-61.)
    from scipy.stats import chi2_contingency

    model = _model(seed=1, copying_mtp=True)
    ids = _left_padded_batch()[0][:1, -3:].repeat(2000, 1)
    torch.manual_seed(0)
    plain = model.generate(ids, max_new_tokens=4, **SAMPLING)[:, 3:]
    torch.manual_seed(1)
    drafted = model.generate(ids, max_new_tokens=4, use_mtp_head=True, **SAMPLING)[:, 3:]
    table = _joint_counts(plain, drafted)
    assert table.shape[1] > 20  # the test sees a spread distribution, not a few tokens
    assert chi2_contingency(table).pvalue > 1e-3


def test_mtp_sampling_is_seeded_and_stays_in_the_warped_support():
    # Batch 1, where every kept draft also brings the token after it from the same forward.
    model = _model(seed=1, copying_mtp=True)
    ids = _left_padded_batch()[0][:1]
    drafted = accepted = 0
    for seed in range(4):
        torch.manual_seed(seed)
        out = model.generate(ids, max_new_tokens=16, use_mtp_head=True, return_dict_in_generate=True, **SAMPLING)
        torch.manual_seed(seed)
        assert torch.equal(model.generate(ids, max_new_tokens=16, use_mtp_head=True, **SAMPLING), out.sequences)
        drafted, accepted = drafted + out.drafted, accepted + out.accepted
        # Every token lies in the top_k=4 support of the plain distribution at its position.
        logits = model(out.sequences).logits[0, PROMPT - 1 : -1]  # [16, V]
        support = logits.topk(4, dim=-1).indices
        assert (support == out.sequences[0, PROMPT:, None]).any(-1).all()
    assert 0 < accepted < drafted


def test_prompt_lookup_writes_the_greedy_tokens_on_the_demo(demo_folder):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(demo_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_folder)
    tools = [{"name": "send_message", "description": "Send a text message to a contact.",
              "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "text": {"type": "string"}},
                             "required": ["to", "text"]}}]
    for query in ("Text Alice that dinner is ready.", "Send a message to Bob saying see you soon."):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": query}], tools=tools,
                                               add_generation_prompt=True, tokenize=False)
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        plain = model.generate(**inputs, do_sample=False, max_new_tokens=48)
        lookup = model.generate(**inputs, do_sample=False, max_new_tokens=48, prompt_lookup_num_tokens=10)
        assert torch.equal(lookup, plain)


def test_prompt_lookup_writes_the_greedy_tokens_up_to_the_length_limit():
    # The random tiny model repeats one token, so every lookup candidate holds and the loop runs
    # into max_new_tokens (transformers 4.57 alone would return a few tokens more).
    model = _model(seed=1, copying_mtp=False)
    ids, mask = _left_padded_batch()
    options = {**GREEDY, "eos_token_id": 1}  # prompt lookup needs an EOS id; this model never writes it
    plain = model.generate(ids[:1], **options)
    for output in (model.generate(ids[:1], prompt_lookup_num_tokens=4, **options),
                   model.generate(ids[:1], prompt_lookup_num_tokens=4, return_dict_in_generate=True,
                                  output_logits=True, **options).sequences):
        assert torch.equal(output, plain)


@pytest.mark.parametrize("options, problem", [
    ({"use_mtp_head": "yes"}, r"use_mtp_head: expected True, False or None, found 'yes'"),
    ({"use_mtp_head": 1}, r"use_mtp_head: expected True, False or None, found 1"),
    ({"use_mtp_head": True, "prompt_lookup_num_tokens": 3}, r"does not take prompt_lookup_num_tokens=3"),
    ({"attention_window": -1}, r"attention_window: expected an int >= 0 \(0: full attention\), found -1"),
    ({"attention_window": 1.5}, r"attention_window: expected an int >= 0"),
    ({"attention_window": True}, r"attention_window: expected an int >= 0"),
    ({"attention_window": "16", "use_mtp_head": True}, r"attention_window: expected an int >= 0"),
])
def test_generate_refuses_bad_mtp_and_window_options_naming_them(options, problem):
    model = _model(seed=1, copying_mtp=False)
    ids, mask = _left_padded_batch()
    with pytest.raises(ValueError, match=problem):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, **options)


@pytest.mark.parametrize("use_mtp", [False, True])
@pytest.mark.parametrize("prompt, problem", [
    (torch.ones(1, 3), r"input_ids: expected an integer tensor \[batch, tokens\], found torch.float32 of shape \(1, 3\)"),
    (torch.tensor([5, 6]), r"input_ids: expected an integer tensor \[batch, tokens\], found torch.int64 of shape \(2,\)"),
    (torch.tensor([[5, 10**6]]), r"input_ids: expected ids in \[0, 512\) \(config.vocab_size\), found 5..1000000"),
    (torch.tensor([[-1, 5]]), r"input_ids: expected ids in \[0, 512\)"),
    ([[5, 6]], r"input_ids: expected an integer tensor \[batch, tokens\], found list"),
])
def test_generate_refuses_prompts_that_are_not_token_ids(prompt, problem, use_mtp):
    model = _model(seed=1, copying_mtp=False)
    with pytest.raises(ValueError, match=problem):
        model.generate(prompt, max_new_tokens=2, do_sample=False, use_mtp_head=use_mtp)
