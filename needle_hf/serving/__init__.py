"""Serving engines: the vLLM plugin (`needle_hf.serving.vllm`)."""
