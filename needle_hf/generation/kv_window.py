"""The sliding KV window of Needle's engine, for `NeedleConfig.attention_window`.

Needle's on-device engine keeps a bounded KV cache: each token attends to the last ``kv_window``
positions only. The window is the checkpoint's ``kv_window`` when set, capped by what fits a fixed
KV budget, and never below a floor. The budget counts, per position, 8-bit keys and values of every
layer plus a float32 scale per group of 32 channels, and the same for one engram row per engram site.

When each applies:
- Full attention (``attention_window=0``, the default) is what the reference's training forward and
  these models compute; use it for prompts up to the context length.
- ``attention_window=engine_kv_window(config)`` reproduces the engine's (and the reference's
  ``decode.py`` with ``kv_window``) answers on prompts longer than the window, e.g. to check what
  the phone will answer, or to bound attention cost on very long contexts.
"""

from __future__ import annotations

KV_BUDGET_BYTES = 11 * 2**20 + 2**19  # 11.5 MiB of KV per sequence
KV_SCALE_GROUP = 32  # channels per float32 scale; the window is also a multiple of it
KV_WINDOW_FLOOR = 160


_GEOMETRY = ("num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers", "engram_layers",
             "max_position_embeddings", "kv_window")


def _check_config(config) -> None:
    """A Needle config (this package's or a remote-code copy of it: the fields, not the class, matter)."""
    missing = [name for name in _GEOMETRY if not hasattr(config, name)]
    if missing:
        raise TypeError(f"config: expected a NeedleConfig, found {type(config).__name__} without {', '.join(missing)}")


def kv_budget_window(config) -> int:
    """Positions that fit the engine's KV budget for ``config`` (a `NeedleConfig`), in [floor, context]."""
    _check_config(config)
    kv_width = config.num_key_value_heads * config.head_dim
    width = config.hidden_size
    per_layer = 2 * kv_width + 2 * (kv_width // KV_SCALE_GROUP) * 4
    per_site = width + (width // KV_SCALE_GROUP) * 4
    per_position = config.num_hidden_layers * per_layer + len(config.engram_layers) * per_site
    window = (KV_BUDGET_BYTES // per_position) // KV_SCALE_GROUP * KV_SCALE_GROUP
    return max(KV_WINDOW_FLOOR, min(window, config.max_position_embeddings))


def engine_kv_window(config) -> int:
    """The window the engine decodes with: ``config.kv_window`` capped by the budget, else the budget."""
    _check_config(config)
    budget = kv_budget_window(config)
    return min(budget, config.kv_window) if config.kv_window else budget


__all__ = ["engine_kv_window", "kv_budget_window"]
