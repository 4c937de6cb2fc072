"""Needle 2: exactly the files a saved folder ships as remote code (`trust_remote_code=True`).

Configuration, the PyTorch and Flax twins (with their deploy numerics and MTP speculative
decoding, which the models' own `forward` and `generate` call), the tokenizer and its chat format,
the constants and weight table both twins share, and the remote-code writer the configuration's
save hook calls. The files import each other only as flat relative imports (`from .numerics
import ...`) and nothing else from `needle_hf`: transformers copies them into a flat folder.
"""
