"""Make the small, briefly trained Needle 2 base checkpoint of the demo (needle_hf/demo/).

scripts/train_demo.py then retrains it through the Hugging Face path into the checkpoint the main
job converts (same file); this script records how the base was made.

The released Needle 2 weights and tokenizer live on the Hugging Face Hub, which this project's
machines cannot reach. The demo therefore ships a stand-in made here, reproducibly (fixed seeds):
  * tokenizer.model: a SentencePiece BPE model trained with the Needle tokenizer settings
    (tests/support/spm_fixture.py) on its built-in corpus, 800 pieces;
  * needle2-demo.pkl: a native format_version 2 checkpoint of a small Needle 2 geometry
    (d=128, 4 layers, engram layers 1 and 3), written the way the reference writes checkpoints.
    It starts from the reference's own initialisation (cactus-needle 2.0.15, seed 0) and is then
    trained for 160 Adam steps (JAX + optax, float32, on the CPU) on a synthetic
    tool-calling data set built below: five phone tools (set_alarm, send_message, play_music,
    set_temperature, get_weather), templated queries with random slot values, each prompt
    offering the right tool among one or two tools. Examples are rendered and tokenised
    exactly as the reference's fine-tuning does (`needle.model.finetune.render_example`,
    `[BOS] + encode(prompt) + encode(target) + [EOS]`, loss on the target and the EOS only).
    Only the next-token path is trained; the MTP, contrastive and confidence heads keep their
    initial values (they are shipped so the converter and the models see every head).
The model answers in-distribution prompts with a well-formed tool call, usually naming the right
tool; slot values are sometimes wrong. It is a toy for exercising the pipeline, not a useful model.
At the end the script greedily decodes held-out prompts with the reference model and prints how
many parse with `needle_hf.tools.tool_calls.parse_tool_calls` and name the right tool.

    .venv/bin/python scripts/make_demo_checkpoint.py        # about 3 minutes on 2 CPU cores
"""

import json
import os
import pickle
import shutil
import sys
import tempfile
import time

import numpy as np

from needle_hf.demo.data import CITIES, CONTACTS, MESSAGES, QUERY_TEMPLATES, SONGS

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))

DEMO_DIR = os.path.join(os.path.dirname(HERE), "needle_hf", "demo")  # the demo ships inside the package
DEMO_CONFIG = dict(
    vocab_size=800,
    d_model=128,
    num_heads=4,
    num_kv_heads=2,
    num_layers=4,
    max_seq_len=512,
    engram_layers=(1, 3),
    engram_slots=1024,
    contrastive_dim=32,
)
INIT_SEED = 0
DATA_SEED = 1
HELD_OUT_SEED = 2
TRAIN_EXAMPLES = 3000
HELD_OUT_EXAMPLES = 60
TRAIN_STEPS = 160
BATCH_SIZE = 16
PEAK_LEARNING_RATE = 3e-3
MAX_NEW_TOKENS = 48


def demo_tools():
    """The five tools of the synthetic data set (needle_hf.demo.data); set_alarm is the main job's."""
    from needle_hf.demo.data import DEMO_DATA_TOOLS

    return DEMO_DATA_TOOLS


def _slot_values(name, rng):
    """Random arguments for tool `name` and the text each one takes in the query."""
    if name == "set_alarm":
        hour, minute = int(rng.integers(0, 24)), int(rng.choice([0, 5, 10, 15, 20, 30, 40, 45, 50]))
        return {"time": f"{hour:02d}:{minute:02d}"}, {"time": f"{hour}:{minute:02d}"}
    if name == "send_message":
        arguments = {"to": str(rng.choice(CONTACTS)), "text": str(rng.choice(MESSAGES))}
        return arguments, arguments
    if name == "play_music":
        arguments = {"song": str(rng.choice(SONGS))}
        return arguments, arguments
    if name == "set_temperature":
        degrees = int(rng.integers(16, 29))
        return {"degrees": degrees}, {"degrees": str(degrees)}
    arguments = {"city": str(rng.choice(CITIES))}
    return arguments, arguments


def make_examples(count, seed):
    """`count` reference-format examples {"tools", "query", "answers"}: the right tool among 1-2 offered."""
    rng = np.random.default_rng(seed)
    tools = demo_tools()
    examples = []
    for _ in range(count):
        target = int(rng.integers(len(tools)))
        others = [i for i in range(len(tools)) if i != target]
        offered = [target] + [int(i) for i in rng.choice(others, size=int(rng.integers(0, 2)), replace=False)]
        rng.shuffle(offered)
        name = tools[target]["name"]
        arguments, slots = _slot_values(name, rng)
        query = str(rng.choice(QUERY_TEMPLATES[name])).format(**slots)
        examples.append({"tools": [tools[i] for i in offered], "query": query,
                         "answers": [{"name": name, "arguments": arguments}]})
    return examples


def encode_examples(examples, sp):
    """Token ids and loss masks, padded right to a common length, the way the reference encodes them.

    Returns:
        ids [N, T] int32 (pad 0) and loss_mask [N, T] float32 (1 on target tokens and the EOS).
    """
    from needle.model.finetune import render_example

    rows = []
    for example in examples:
        prompt, target = render_example(example)
        prompt_ids, target_ids = sp.encode(prompt), sp.encode(target)
        rows.append(([sp.bos_id()] + prompt_ids + target_ids + [sp.eos_id()],
                     [0.0] * (1 + len(prompt_ids)) + [1.0] * (len(target_ids) + 1)))
    length = -(-max(len(ids) for ids, _ in rows) // 32) * 32
    ids = np.zeros((len(rows), length), np.int32)
    loss_mask = np.zeros((len(rows), length), np.float32)
    for row, (row_ids, row_mask) in enumerate(rows):
        ids[row, :len(row_ids)] = row_ids
        loss_mask[row, :len(row_mask)] = row_mask
    return ids, loss_mask


def reference_model():
    from needle.model.architecture import SimpleAttentionNetwork, TransformerConfig

    # flash/remat are runtime switches of the reference, not part of the checkpoint's config.
    return SimpleAttentionNetwork(TransformerConfig(**DEMO_CONFIG, dtype="float32", flash=False, remat=False))


def reference_params(model, seed=INIT_SEED):
    """The reference's initial parameters, every head included, as float32 numpy arrays."""
    import jax
    import jax.numpy as jnp

    tokens = jnp.zeros((1, 8), jnp.int32)
    rng = jax.random.PRNGKey(seed)
    params = dict(model.init(rng, tokens)["params"])
    params["contrastive_head"] = model.init(rng, tokens, method=model.encode_contrastive)["params"]["contrastive_head"]
    params["confidence_head"] = model.init(rng, tokens, method=model.forward_confidence)["params"]["confidence_head"]
    return jax.tree.map(lambda a: np.asarray(a, np.float32), params)


def train(model, params, ids, loss_mask):
    """Adam on the next-token loss of the target tokens; returns (params, per-step losses)."""
    import jax
    import jax.numpy as jnp
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LEARNING_RATE, 20, TRAIN_STEPS, PEAK_LEARNING_RATE / 20)
    # Plain Adam (no weight decay): the heads off the next-token path get zero gradients and so stay at init.
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))

    def loss_fn(trainable, tokens, weights):
        logits = model.apply({"params": trainable}, tokens[:, :-1])  # [B, T-1, V]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])  # [B, T-1]
        return jnp.sum(losses * weights[:, 1:]) / jnp.sum(weights[:, 1:])

    @jax.jit
    def step(trainable, opt_state, tokens, weights):
        loss, grads = jax.value_and_grad(loss_fn)(trainable, tokens, weights)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    rng = np.random.default_rng(DATA_SEED)
    opt_state = optimizer.init(params)
    losses = []
    for index in range(TRAIN_STEPS):
        batch = rng.choice(len(ids), size=BATCH_SIZE, replace=False)
        # One padded length for every batch: a single compile.
        params, opt_state, loss = step(params, opt_state, jnp.asarray(ids[batch]), jnp.asarray(loss_mask[batch]))
        losses.append(float(loss))
        if index % 20 == 0 or index == TRAIN_STEPS - 1:
            print(f"  step {index:4d}  loss {losses[-1]:.4f}", flush=True)
    return jax.tree.map(lambda a: np.asarray(a, np.float32), params), losses


def greedy_decode(model, params, prompts, sp):
    """Greedy continuations of `prompts` (lists of ids) with the reference model, no cache.

    All rows sit right-padded in one [N, T] buffer; the model is causal, so the pads after a row's
    end never reach that row's last position, whose logits pick the next token.
    """
    import jax
    import jax.numpy as jnp

    length = -(-(max(len(p) for p in prompts) + MAX_NEW_TOKENS) // 32) * 32
    buffer = np.zeros((len(prompts), length), np.int32)
    ends = np.array([len(p) for p in prompts])
    for row, prompt in enumerate(prompts):
        buffer[row, :len(prompt)] = prompt
    forward = jax.jit(lambda p, tokens: model.apply({"params": p}, tokens))
    done = np.zeros(len(prompts), bool)
    for _ in range(MAX_NEW_TOKENS):
        logits = np.asarray(forward(params, jnp.asarray(buffer)))  # [N, T, V]
        next_ids = logits[np.arange(len(prompts)), ends - 1].argmax(-1)
        live = ~done
        buffer[np.arange(len(prompts))[live], ends[live]] = next_ids[live]
        done |= next_ids == sp.eos_id()
        ends += live
        if done.all():
            break
    return [sp.decode([int(t) for t in buffer[row, len(p):ends[row]] if t != sp.eos_id()])
            for row, p in enumerate(prompts)]


def evaluate(model, params, sp):
    """Print and return (parse rate, right-tool rate, exact-call rate) on held-out prompts."""
    from needle.model.finetune import render_example

    from needle_hf.demo import DEMO_QUERY, DEMO_TOOLS
    from needle_hf.tools.tool_calls import ToolCallParseError, parse_tool_calls

    examples = make_examples(HELD_OUT_EXAMPLES, HELD_OUT_SEED)
    examples.append({"tools": [DEMO_TOOLS[0]["function"]], "query": DEMO_QUERY,
                     "answers": [{"name": "set_alarm", "arguments": {}}]})
    prompts = [[sp.bos_id()] + sp.encode(render_example(example)[0]) for example in examples]
    texts = greedy_decode(model, params, prompts, sp)
    parsed = right_tool = exact = 0
    for example, text in zip(examples, texts):
        try:
            calls = parse_tool_calls(text)
        except ToolCallParseError:
            continue
        parsed += 1
        right_tool += [call["name"] for call in calls] == [example["answers"][0]["name"]]
        exact += calls == example["answers"]
    total = len(examples)
    print(f"held-out prompts: {parsed}/{total} parse as tool calls, {right_tool}/{total} name the right tool, "
          f"{exact}/{total} exactly right (the last prompt is the demo's, exact match not expected)")
    print(f"  demo query {DEMO_QUERY!r} -> {texts[-1]!r}")
    for example, text in list(zip(examples, texts))[:3]:
        print(f"  {example['query']!r} -> {text!r}")
    return parsed / total, right_tool / total, exact / total


def main():
    import sentencepiece
    from spm_fixture import train_needle_spm

    started = time.perf_counter()
    os.makedirs(DEMO_DIR, exist_ok=True)
    tokenizer_path = os.path.join(DEMO_DIR, "tokenizer.model")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(train_needle_spm(tmp, vocab_size=DEMO_CONFIG["vocab_size"]), tokenizer_path)
    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_path)

    ids, loss_mask = encode_examples(make_examples(TRAIN_EXAMPLES, DATA_SEED), sp)
    print(f"{len(ids)} training examples, up to {int((ids != 0).sum(1).max())} tokens, "
          f"{TRAIN_STEPS} steps of {BATCH_SIZE}")
    model = reference_model()
    params, losses = train(model, reference_params(model), ids, loss_mask)
    print(f"training loss {np.mean(losses[:10]):.3f} (first 10 steps) -> {np.mean(losses[-10:]):.3f} (last 10)")

    checkpoint = {"format_version": 2, "params": params, "config": DEMO_CONFIG, "step": TRAIN_STEPS,
                  "run": {"stage": "demo", "data": "synthetic tool calls", "seed": INIT_SEED}}
    path = os.path.join(DEMO_DIR, "needle2-demo.pkl")
    with open(path, "wb") as f:
        pickle.dump(checkpoint, f, protocol=4)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB) and {tokenizer_path}")
    evaluate(model, params, sp)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
