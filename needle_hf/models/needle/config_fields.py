"""Checks of config fields, shared by the Needle configs (Needle 2's and Needle 3's).

Each check turns a value read from config.json, or given by a caller, into the field's type, or
raises `ValueError` naming the config, the field, what was expected and what was found. A config
binds the checks to its own name and list-length cap once (`ConfigFields`).
"""

from __future__ import annotations

import math

# Upper bound of an integer field: far above any real geometry, low enough that derived sizes stay
# small integers (a hostile config.json cannot ask for a 2^60-row table).
MAX_FIELD_VALUE = 1 << 24


def shown(value) -> str:
    """A short form of a found value for an error message."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({type(value).__name__})"


class ConfigFields:
    """The field checks of one config class.

    Args:
        config_name: the class name the errors start with (`Invalid NeedleConfig: ...`).
        max_list_length: the most entries a list field may hold.
    """

    def __init__(self, config_name: str, *, max_list_length: int):
        self.prefix = f"Invalid {config_name}"
        self.max_list_length = max_list_length

    def integer(self, name, value, *, minimum, maximum=MAX_FIELD_VALUE) -> int:
        """`value` as an int in [minimum, maximum]; a bool, a fraction, text, None or a list is an error."""
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) and not type(value).__name__.startswith(("int", "uint")):
            raise ValueError(f"{self.prefix}: {name} must be an integer, got {shown(value)}")
        value = int(value)
        if not minimum <= value <= maximum:
            raise ValueError(f"{self.prefix}: {name} must be in [{minimum}, {maximum}], got {value}")
        return value

    def integers(self, name, values, *, minimum) -> list[int]:
        """A list (or tuple) of at most `max_list_length` integers, each at least `minimum`."""
        if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or len(values) > self.max_list_length:
            raise ValueError(f"{self.prefix}: {name} must be a list of at most {self.max_list_length} integers, "
                             f"got {shown(values)}")
        return [self.integer(f"{name}[{index}]", value, minimum=minimum) for index, value in enumerate(values)]

    def real(self, name, value) -> float:
        """A finite positive float (a NaN or Inf would also make config.json invalid JSON)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not type(value).__name__.startswith("float"):
            raise ValueError(f"{self.prefix}: {name} must be a number, got {shown(value)}")
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{self.prefix}: {name} must be a finite positive number, got {value}")
        return value

    def flag(self, name, value) -> bool:
        """A bool (0 and 1 as written by older configs count)."""
        if not isinstance(value, bool) and value not in (0, 1):
            raise ValueError(f"{self.prefix}: {name} must be true or false, got {shown(value)}")
        return bool(value)


# Number of taps in each engram's dilated causal convolution (fixed by the architecture).
ENGRAM_CONV_TAPS = 4
# Engram sub-table width the reference uses to pick a default number of hash heads.
ENGRAM_TARGET_SUB_DIM = 128


class EngramGeometry:
    """The engram geometry derived from `hidden_size`, `engram_orders` and `engram_heads`, shared by the
    Needle 2 and Needle 3 configs (the one place each derivation is written down)."""

    @property
    def engram_num_heads(self) -> int:
        """Hash heads per n-gram order (resolves `engram_heads=0`)."""
        return self.engram_heads or max(1, self.hidden_size // (len(self.engram_orders) * ENGRAM_TARGET_SUB_DIM))

    @property
    def engram_num_tables(self) -> int:
        """One hash table per (order, head): table k = order_index * heads + head."""
        return len(self.engram_orders) * self.engram_num_heads

    @property
    def engram_sub_dim(self) -> int:
        return self.hidden_size // self.engram_num_tables

    @property
    def engram_dim(self) -> int:
        """Width of the concatenated table rows fed to the engram key/value projections."""
        return self.engram_num_tables * self.engram_sub_dim

    @property
    def engram_conv_dilation(self) -> int:
        return max(self.engram_orders)

    @property
    def engram_conv_taps(self) -> int:
        return ENGRAM_CONV_TAPS

    @property
    def engram_conv_reach(self) -> int:
        """Earlier positions the engram's dilated convolution reads: (taps - 1) * dilation."""
        return (ENGRAM_CONV_TAPS - 1) * self.engram_conv_dilation

    @property
    def engram_history(self) -> int:
        """Earlier tokens an engram output depends on: the conv reaches back `engram_conv_reach`
        positions, and the n-gram hashed there reaches back max(orders) - 1 more."""
        return self.engram_conv_reach + max(self.engram_orders) - 1
