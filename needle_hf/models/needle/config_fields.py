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
