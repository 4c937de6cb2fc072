"""needle-hf: Needle 2 for Hugging Face Transformers."""

from .configuration_needle import NeedleConfig

__all__ = ["NeedleConfig"]
