"""The tool-calling SDK: the reference SDK's `Needle`, `extract`, `tool` and `Field` on Hugging Face models.

`tools_schema` builds tool schemas from Python, `validation` checks that arguments are grounded in
what the user said, `engine` runs one answer on either twin, `needle` holds the agent, and
`pipeline` the `pipeline("tool-calling")` task. Importing this package imports neither torch nor jax.
"""

from .needle import ExtractionValidationError, Needle, extract
from .tools_schema import Field, build_schema, pydantic_schema, tool

__all__ = ["ExtractionValidationError", "Field", "Needle", "build_schema", "extract", "pydantic_schema", "tool"]
