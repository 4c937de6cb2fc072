"""Make the small Needle 2 checkpoint the main job converts (scripts/demo/).

The released Needle 2 weights and tokenizer live on the Hugging Face Hub, which this project's
machines cannot reach. The demo therefore ships a stand-in made here, reproducibly:
  * tokenizer.model: a SentencePiece BPE model trained with the Needle tokenizer settings
    (tests/spm_fixture.py) on its built-in corpus, 800 pieces;
  * needle2-demo.pkl: a native format_version 2 checkpoint of a small Needle 2 geometry with the
    reference's own initialisation (cactus-needle 2.0.15, seed 0), including the MTP, contrastive
    and confidence heads, written the way the reference writes checkpoints.
The weights are untrained, so generated text is not meaningful; the point is the pipeline.

    .venv/bin/python scripts/make_demo_checkpoint.py
"""

import os
import pickle
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

DEMO_DIR = os.path.join(HERE, "demo")
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


def reference_params(seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    from needle.model.architecture import SimpleAttentionNetwork, TransformerConfig

    model = SimpleAttentionNetwork(TransformerConfig(**DEMO_CONFIG, dtype="float32"))
    tokens = jnp.zeros((1, 8), jnp.int32)
    rng = jax.random.PRNGKey(seed)
    params = dict(model.init(rng, tokens)["params"])
    params["contrastive_head"] = model.init(rng, tokens, method=model.encode_contrastive)["params"]["contrastive_head"]
    params["confidence_head"] = model.init(rng, tokens, method=model.forward_confidence)["params"]["confidence_head"]
    return jax.tree.map(lambda a: np.asarray(a, np.float32), params)


def main():
    from spm_fixture import train_needle_spm

    os.makedirs(DEMO_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(train_needle_spm(tmp, vocab_size=DEMO_CONFIG["vocab_size"]), os.path.join(DEMO_DIR, "tokenizer.model"))
    checkpoint = {"format_version": 2, "params": reference_params(), "config": DEMO_CONFIG, "step": 0, "run": {"stage": "demo"}}
    path = os.path.join(DEMO_DIR, "needle2-demo.pkl")
    with open(path, "wb") as f:
        pickle.dump(checkpoint, f, protocol=4)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB) and {DEMO_DIR}/tokenizer.model")


if __name__ == "__main__":
    main()
