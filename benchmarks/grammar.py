"""Grammar-constrained tool calls: llguidance vs xgrammar, and what the constraint buys on the demo.

Part 1 (engines). For each engine: the one-off vocabulary set-up, the compile time of one request's
tool-call grammar (the five demo tools), and the time to compute the next-token mask at every
position of a reference answer (median and worst over the answer), on Needle's demo vocabulary
(800 pieces) and on an 8192-piece vocabulary (the Needle 2 size: the demo pieces plus synthetic
pieces made of two demo pieces). Both engines get the same token bytes (`grammar.token_bytes`);
xgrammar's JSON grammars cannot name token ids, so its markers are matched as text there.

Part 2 (demo, llguidance, as shipped in `needle_hf.generation.grammar`). Held-out prompts of the demo data set
(`scripts/make_demo_checkpoint.py`, held-out seed), greedy PyTorch `generate()` with and without
`ToolCallLogitsProcessor`: the share of answers that parse and validate against their tool's schema,
the exact tool-call accuracy (names and arguments equal to the target), and the processor's
overhead per generated token.

    .venv/bin/python benchmarks/grammar.py [--prompts 200] [--skip-demo]

Recorded run (project machine, 2 shared CPU cores, demo checkpoint of commit 26c9412):

| engine     | vocabulary | set-up ms | compile ms | mask us median | mask us max |
|------------|-----------:|----------:|-----------:|---------------:|------------:|
| llguidance |        800 |       1.7 |       1.38 |              8 |         103 |
| xgrammar   |        800 |       0.3 |       1.45 |              5 |         211 |
| llguidance |       8192 |      11.3 |       1.36 |              8 |          96 |
| xgrammar   |       8192 |      10.3 |       2.91 |              5 |         140 |

| decoding (200 held-out prompts, batch 20) | schema-valid | exact tool calls | ms per generated token |
|-------------------------------------------|-------------:|-----------------:|-----------------------:|
| plain                                     |       100.0% |            99.5% |                   1.99 |
| constrained (llguidance)                  |       100.0% |            99.5% |                   2.24 |

(The retrained demo, its held-out split: queries never trained on; one run at load average ~1.5
with a test run beside it, so the per-token times are indicative. On the earlier demo and prompt
set: 100% / 68.5% both ways, 0.70 vs 1.12 ms per token.)

Choice: llguidance. Both engines are far below a decoding step (the Needle 2 geometry takes
milliseconds per token); llguidance compiles the request's grammar 2x faster, has the lower worst
case, addresses the marker tokens by id, and needs no torch/triton. The demo already writes
well-formed answers, so the constraint changes no answer there; on a random model (tests) it turns
0% well-formed into 100%. The processor's overhead (0.4 ms per generated token at batch 20, i.e.
about 20 us per row and step) is the per-row mask plus its host-to-tensor copy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
DEMO_TOKENIZER = os.path.join(REPO, "needle_hf", "demo", "tokenizer.model")
DEMO_CHECKPOINT = os.path.join(REPO, "needle_hf", "demo", "needle2-demo.pkl")
NEEDLE2_VOCAB = 8192


def widened_vocabulary(tokens: list[bytes], special: list[int], size: int) -> list[bytes]:
    """`tokens` followed by distinct two-piece concatenations of its normal pieces, up to `size`."""
    rng = np.random.default_rng(0)
    normal = [t for i, t in enumerate(tokens) if i not in set(special) and len(t) > 1]
    seen, out = set(tokens), list(tokens)
    while len(out) < size:
        piece = normal[rng.integers(len(normal))] + normal[rng.integers(len(normal))]
        if piece not in seen:
            seen.add(piece)
            out.append(piece)
    return out


def time_llguidance(tokenizer, tokens, special, tools, answer_ids):
    import llguidance

    from needle_hf.generation.grammar import ToolCallGrammar, _PieceEncoder, allowed_tokens

    encoder = _PieceEncoder(tokenizer)
    encoder.tokens = tokens
    start = time.perf_counter()
    llg_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(encoder), n_vocab=len(tokens))
    setup = time.perf_counter() - start
    grammar = ToolCallGrammar(tokenizer)
    grammar.llg_tokenizer, grammar.vocab_size = llg_tokenizer, len(tokens)
    lark = grammar.lark(tools)
    compiles = []
    for _ in range(5):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(llg_tokenizer, lark, log_level=0)
        compiles.append(time.perf_counter() - start)
    masks = []
    for token in answer_ids:
        start = time.perf_counter()
        mask = allowed_tokens(matcher, len(tokens))
        masks.append(time.perf_counter() - start)
        assert mask[token], f"llguidance forbids token {token} of the reference answer"
        matcher.consume_token(token)
    return setup, statistics.median(compiles), masks


def time_xgrammar(tokens, special, tools, answer_ids, marker_text):
    import torch
    import xgrammar

    from needle_hf.generation.grammar import tool_calls_json_schema

    # Markers as their text (xgrammar's JSON grammars address text, not token ids).
    vocab = [marker_text.get(i, t) for i, t in enumerate(tokens)]
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[1])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    payload = json.dumps(tool_calls_json_schema(tools))

    def build():
        return xgrammar.Grammar.concat(
            xgrammar.Grammar.from_ebnf('root ::= " "? "<tool_call>"'),
            xgrammar.Grammar.from_json_schema(payload, any_whitespace=False, separators=(",", ":")),
            xgrammar.Grammar.from_ebnf('root ::= "</tool_call><|im_end|>"'),
        )

    compiles = []
    for _ in range(5):
        start = time.perf_counter()
        compiled = compiler.compile_grammar(build())
        compiles.append(time.perf_counter() - start)
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))
    masks = []
    for token in answer_ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: len(vocab)].astype(bool)
        masks.append(time.perf_counter() - start)
        assert allowed[token], f"xgrammar forbids token {token} of the reference answer"
        assert matcher.accept_token(token)
    del torch
    return setup, statistics.median(compiles), masks


def engines(tokenizer, tools):
    from needle_hf.generation.grammar import token_bytes

    tokens, special = token_bytes(tokenizer)
    answer = '<tool_call>[{"name":"send_message","arguments":{"to":"Alice","text":"see you soon"}}]</tool_call><|im_end|>'
    answer_ids = tokenizer(answer, add_special_tokens=False).input_ids
    marker_text = {i: tokenizer.convert_ids_to_tokens(i).encode() for i in range(4, 14)}
    print("| engine | vocabulary | set-up ms | compile ms | mask us median | mask us max |")
    print("|---|---|---|---|---|---|")
    for size in (len(tokens), NEEDLE2_VOCAB):
        vocab = widened_vocabulary(tokens, special, size) if size > len(tokens) else tokens
        for name, run in (("llguidance", lambda: time_llguidance(tokenizer, vocab, special, tools, answer_ids)),
                          ("xgrammar", lambda: time_xgrammar(vocab, special, tools, answer_ids, marker_text))):
            setup, compile_s, masks = run()
            print(f"| {name} | {size} | {setup * 1e3:.1f} | {compile_s * 1e3:.2f} | "
                  f"{statistics.median(masks) * 1e6:.0f} | {max(masks) * 1e6:.0f} |")


def demo(tokenizer, prompts: int, batch: int):
    import tempfile

    import jsonschema
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    import needle_hf  # noqa: F401
    from needle_hf.conversion.convert import convert
    from needle_hf.demo.data import DEMO_HELD_OUT_SEED, make_demo_examples
    from needle_hf.generation.grammar import ToolCallGrammar, tool_schema
    from needle_hf.tools.tool_calls import ToolCallParseError, parse_tool_calls

    torch.set_num_threads(1)
    folder = os.path.join(tempfile.mkdtemp(), "demo")
    convert(DEMO_CHECKPOINT, folder, tokenizer=DEMO_TOKENIZER)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    grammar = ToolCallGrammar(tokenizer)
    examples = make_demo_examples(prompts, seed=DEMO_HELD_OUT_SEED, split="held_out")  # queries never trained on
    stats = {}
    for constrained in (False, True):
        valid = exact = tokens = 0
        seconds = 0.0
        for start in range(0, len(examples), batch):
            chunk = examples[start:start + batch]
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": e["query"]}], tools=e["tools"],
                                                   add_generation_prompt=True, tokenize=False) for e in chunk]
            inputs = tokenizer(texts, return_tensors="pt", add_special_tokens=False, padding=True)
            # Every row of a batch shares the processor's tools: offer the union, validate per row.
            offered = {t["name"]: t for e in chunk for t in e["tools"]}
            processors = LogitsProcessorList([grammar.logits_processor(list(offered.values()))] if constrained else [])
            began = time.perf_counter()
            with torch.no_grad():
                out = model.generate(**inputs, do_sample=False, max_new_tokens=48, logits_processor=processors,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            seconds += time.perf_counter() - began
            for example, row in zip(chunk, out[:, inputs["input_ids"].shape[1]:]):
                ids = [t for t in row.tolist() if t not in (tokenizer.eos_token_id, tokenizer.pad_token_id)]
                tokens += len(ids)
                try:
                    calls = parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))
                    schemas = {s["name"]: s["parameters"] for s in map(tool_schema, example["tools"])}
                    for call in calls:
                        jsonschema.validate(call["arguments"], schemas[call["name"]])
                except (ToolCallParseError, KeyError, jsonschema.ValidationError):
                    continue
                valid += 1
                exact += calls == example["answers"]
        stats[constrained] = (valid, exact, tokens, seconds)
    print(f"\ndemo: {len(examples)} held-out prompts, greedy, batch {batch}, PyTorch, 1 thread")
    print("| decoding | schema-valid | exact tool calls | ms per generated token |")
    print("|---|---|---|---|")
    for constrained, (valid, exact, tokens, seconds) in stats.items():
        print(f"| {'constrained' if constrained else 'plain'} | {valid / len(examples):.1%} | "
              f"{exact / len(examples):.1%} | {seconds / max(tokens, 1) * 1e3:.2f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args(argv)
    from make_demo_checkpoint import demo_tools

    from needle_hf.models.needle.tokenization_needle import build_fast_tokenizer

    tokenizer = build_fast_tokenizer(DEMO_TOKENIZER)
    engines(tokenizer, demo_tools())
    if not args.skip_demo:
        demo(tokenizer, args.prompts, args.batch)


if __name__ == "__main__":
    main()
