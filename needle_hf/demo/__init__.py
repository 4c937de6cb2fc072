"""The main job: convert a native Needle 2 checkpoint, load it with the Auto classes, generate.

    python -m needle_hf.demo                      # the small checkpoint shipped in this package
    python -m needle_hf.demo CHECKPOINT.pkl --tokenizer tokenizer.model [--out DIR]

Steps, each printed: convert the checkpoint (native `.pkl` or `.cact`) into a Hugging Face folder,
load it with `FlaxAutoModelForCausalLM` and `AutoTokenizer`, render a tool-calling chat prompt with
the Needle chat template, generate greedily with a jit-compiled `generate()`, and parse the answer
as a tool call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent  # the demo checkpoint and tokenizer ship inside the package
DEMO_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "description": "Set an alarm on the phone.",
            "parameters": {
                "type": "object",
                "properties": {"time": {"type": "string", "description": "HH:MM, 24-hour clock"}},
                "required": ["time"],
            },
        },
    }
]
DEMO_QUERY = "Wake me up at 7:30 tomorrow."
DEMO_MODEL_DESCRIPTION = (
    "a 0.9M-parameter Needle 2 (d=128, 4 layers) fine-tuned with transformers' Trainer "
    "(scripts/train_demo.py) on synthetic calls of five phone tools (set_alarm, send_message, play_music, "
    "set_temperature, get_weather), with its MTP, tool-routing and confidence heads trained; it answers such "
    "requests, nothing else"
)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m needle_hf.demo", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="native .pkl or .cact (default: the shipped demo checkpoint)")
    parser.add_argument("--tokenizer", help="SentencePiece tokenizer.model (default: the demo's, or the .cact's own)")
    parser.add_argument("--out", default="needle2-hf", help="output folder for the HF model (replaced if it exists)")
    parser.add_argument("--query", default=DEMO_QUERY)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    checkpoint, tokenizer_path = args.checkpoint, args.tokenizer
    if checkpoint is None:
        checkpoint = DEMO_DIR / "needle2-demo.pkl"
        tokenizer_path = tokenizer_path or DEMO_DIR / "tokenizer.model"
        print(f"[demo] no checkpoint given: using the shipped demo checkpoint {checkpoint}: {DEMO_MODEL_DESCRIPTION}")

    import jax
    from transformers import AutoTokenizer, FlaxAutoModelForCausalLM

    import needle_hf  # noqa: F401  (registers Needle with the Auto classes)
    from needle_hf.conversion.convert import convert
    from needle_hf.tools.tool_calls import ToolCallParseError, parse_tool_calls

    print(f"[1/4] converting {checkpoint} -> {args.out}")
    result = convert(
        checkpoint, args.out, tokenizer=tokenizer_path, overwrite=True, verify_with="auto",
        progress=lambda line: print(f"      {line}"),
    )
    print(f"      {result.summary()}")

    print("[2/4] loading with FlaxAutoModelForCausalLM and AutoTokenizer")
    started = time.perf_counter()
    model = FlaxAutoModelForCausalLM.from_pretrained(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    config = model.config
    print(
        f"      {type(model).__name__}: {config.num_hidden_layers} layers, d={config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads, engram layers {config.engram_layers}, "
        f"vocab {config.vocab_size} ({time.perf_counter() - started:.1f} s)"
    )

    print("[3/4] rendering the chat prompt (Needle chat template, one tool)")
    messages = [{"role": "user", "content": args.query}]
    prompt = tokenizer.apply_chat_template(messages, tools=DEMO_TOOLS, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="np", add_special_tokens=False)
    print(f"      {inputs['input_ids'].shape[1]} prompt tokens: {prompt!r}")

    print(f"[4/4] greedy generate(), {args.max_new_tokens} new tokens, jit-compiled")
    generate = jax.jit(
        lambda ids, mask, params: model.generate(
            ids, attention_mask=mask, params=params, max_new_tokens=args.max_new_tokens, do_sample=False
        ).sequences
    )
    started = time.perf_counter()
    sequences = jax.block_until_ready(generate(inputs["input_ids"], inputs["attention_mask"], model.params))
    first = time.perf_counter() - started
    started = time.perf_counter()
    sequences = jax.block_until_ready(generate(inputs["input_ids"], inputs["attention_mask"], model.params))
    again = time.perf_counter() - started
    new_ids = [int(t) for t in sequences[0, inputs["input_ids"].shape[1]:]]
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])
    while new_ids and new_ids[-1] in eos | {config.pad_token_id}:
        new_ids.pop()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    print(f"      first call {first:.1f} s (compile + run), second call {again:.2f} s; {len(new_ids)} tokens")
    print(f"      generated: {text!r}")
    try:
        print(f"      tool calls: {json.dumps(parse_tool_calls(text))}")
    except ToolCallParseError as error:
        print(f"      no tool call parsed ({error})")
    print(f"[demo] done: the HF folder is {Path(args.out).resolve()}")
    return 0
