"""Model definitions, one folder per model generation (configuration, PyTorch and Flax modeling,
tokenizer and the specification both twins share), each what a saved folder ships as remote code."""
