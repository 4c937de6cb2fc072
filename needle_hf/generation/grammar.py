"""Grammar-constrained tool calls: a logits processor that only lets Needle write a valid answer.

Needle's answer to a tool-calling prompt is one line (see `chat_template`):

    ▁<tool_call>[{"name":...,"arguments":{...}}, ...]</tool_call><|im_end|></s>

`ToolCallGrammar` turns the tools of one request into a grammar of exactly that line: the calls
are a JSON list (compact separators, as the fine-tuning data writes them) whose items name one of
the given tools and carry arguments that satisfy that tool's ``parameters`` schema (required
fields, types, enums, nesting, no extra keys unless the schema allows them). The three markers
are single tokens in Needle's vocabulary and the grammar asks for those tokens by id, so the
text ``<tool_call>`` spelled out of byte pieces can never stand in for the marker. EOS is allowed
only once ``<|im_end|>`` is written. `ToolCallLogitsProcessor` applies the grammar to every row of
a `generate()` batch.

What the grammar admits, `needle_hf.tools.tool_calls.parse_assistant_turn` accepts: `tool_schema` states
what a tool's ``parameters`` may be, and `_Bounder` turns them into a schema whose answers all parse
(references resolved, depth and numbers bounded). A keyword the grammar cannot enforce is refused
with a `ToolGrammarError` naming the tool and the keyword, never loosened.

The grammar engine is llguidance. `benchmarks/grammar.py` measures it against xgrammar (figures in
benchmarks/README.md): both compile and mask far below a decoding step. llguidance wins on what
matters more here: its grammars address tokens by id (xgrammar's JSON grammars match text, so
a spelled-out marker would pass) and it needs neither torch nor triton (xgrammar pulls in both).

Vocabulary. llguidance needs the bytes each token id stands for. Decoding ids one by one with the
tokenizer would be wrong for Needle: its decoder strips the dummy-prefix space from the start of
every decoded text, so ``"▁set"`` would read ``"set"``. `token_bytes` reads the pieces instead:
``"▁"`` is a space, ``"<0xAB>"`` (byte fallback) is the byte 0xAB, the chat markers and
pad/eos/bos/unk are special tokens (no text), everything else is its UTF-8.

Usage::

    grammar = ToolCallGrammar(tokenizer)                 # once per tokenizer
    processor = grammar.logits_processor(tools)          # once per request
    model.generate(**inputs, logits_processor=LogitsProcessorList([processor]))
    pipe(chat, logits_processor=LogitsProcessorList([grammar.logits_processor(tools)]))

One processor serves one `generate()` call (a batch shares the request's tools); beam search is not
supported (beams are reordered behind the processor's back).
"""

from __future__ import annotations

import json
import re
from typing import Optional, Sequence

import numpy as np

from ..models.needle.chat_template import IM_END, TOOL_CALL_END, TOOL_CALL_START
from ..tools.tool_calls import MAX_JSON_DEPTH

SPACE_SYMBOL = "\u2581"  # SentencePiece's escaped space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# llguidance's marker for a special token's bytes: 0xFF never occurs in UTF-8 text.
_SPECIAL_PREFIX = b"\xff"
# JSON layout of the fine-tuning data: compact separators, no free whitespace.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ToolGrammarError(ValueError):
    """A tool schema or tokenizer the tool-call grammar cannot be built from."""


def _require_llguidance():
    try:
        import llguidance
    except ImportError as error:  # the optional extra is missing
        raise ImportError(
            "grammar-constrained tool calls need llguidance: pip install 'needle-hf[grammar]'"
        ) from error
    return llguidance


# A number the grammar lets a model write lies within +-1e15 and is written without an exponent
# (llguidance's bounded-number form), so the parser reads every one as a finite float or short int.
NUMBER_BOUND = 1e15
# JSON depth of the arguments object in the calls list ([{"arguments": {...}}]): list 0, call 1.
_ARGUMENTS_DEPTH = 2
_ANY_TYPES = ["null", "boolean", "number", "string", "array", "object"]
# Keywords llguidance cannot enforce: a schema using one is refused rather than loosened.
_UNSUPPORTED = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains", "propertyNames",
                "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
                "$dynamicRef", "$recursiveRef")
_COMBINATORS = ("anyOf", "oneOf", "allOf")
_LOWER, _UPPER = ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")


def _tool_name(tool) -> str:
    if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        tool = tool["function"]
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ToolGrammarError(f"tool: expected an object with a non-empty string 'name', got {tool!r}")
    return tool["name"]


def tool_schema(tool: dict) -> dict:
    """The bare ``{"name", "description", "parameters"}`` schema of a tool (OpenAI wrappers unwrapped).

    ``parameters`` must describe a JSON object (``"type": "object"``), since a call's arguments are
    one (`needle_hf.tools.tool_calls` refuses anything else); a missing or empty (``{}``) ``parameters``
    means no arguments. The parameters object, and every nested object schema that declares
    ``properties``, gets ``additionalProperties: false`` unless it says otherwise.
    """
    name = _tool_name(tool)
    if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        tool = tool["function"]
    parameters = tool.get("parameters")
    if parameters is None or parameters == {}:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolGrammarError(
            f"tool {name}: 'parameters' must be a JSON schema object, got {type(parameters).__name__}")
    if parameters.get("type", "object") != "object":
        raise ToolGrammarError(f"tool {name}: 'parameters' keyword 'type' must be \"object\" (a call's arguments are "
                               f"a JSON object), got {parameters['type']!r}")
    parameters = {**parameters, "type": "object"}
    if "additionalProperties" not in parameters and "patternProperties" not in parameters:
        parameters["additionalProperties"] = False
    return {**tool, "parameters": parameters}


class _Bounder:
    """Rewrites one tool's parameters schema into the schema the grammar compiles.

    Local ``$ref``s (``#``, ``#/$defs/...``, any JSON pointer into the parameters) become definitions
    of the payload schema, one per (target, JSON depth); every part that admits any value (``{}``,
    ``true``, a missing ``items`` or ``additionalProperties``) becomes an explicit value of bounded
    depth; parts deeper than `needle_hf.tools.tool_calls.MAX_JSON_DEPTH` admit nothing; numbers get
    +-`NUMBER_BOUND`. So every answer the grammar admits is one `parse_tool_calls` accepts.
    """

    def __init__(self, name: str, root: dict, definitions: dict, prefix: str):
        self.name, self.root, self.definitions, self.prefix = name, root, definitions, prefix
        self._refs: dict = {}

    def error(self, path: str, message: str) -> ToolGrammarError:
        return ToolGrammarError(f"tool {self.name}: parameters{path or ''}: {message}")

    def _define(self, key, build) -> dict:
        """A ``$ref`` to the definition ``key`` (built once, by ``build``, after it is named: refs may recurse)."""
        if key not in self._refs:
            name = f"{self.prefix}{len(self._refs)}"
            self._refs[key] = name
            self.definitions[name] = True  # placeholder while its own body refers to it
            self.definitions[name] = build()
        return {"$ref": f"#/$defs/{self._refs[key]}"}

    def any_value(self, depth: int):
        if depth > MAX_JSON_DEPTH:
            return False
        return self._define(("any", depth), lambda: {"anyOf": [
            {"type": ["null", "boolean", "string"]},
            {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND},
            {"type": "array", "items": self.any_value(depth + 1)},
            {"type": "object", "additionalProperties": self.any_value(depth + 1)},
        ]})

    def _resolve(self, pointer: str, path: str):
        if not isinstance(pointer, str) or not pointer.startswith("#"):
            raise self.error(path, f"keyword '$ref' {pointer!r}: only local references (starting with '#') are supported")
        target = self.root
        for part in filter(None, pointer[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise self.error(path, f"keyword '$ref' {pointer!r} points to nothing")
        return target

    def schema(self, node, depth: int, path: str = ""):
        """The bounded form of ``node``, a subschema whose values sit at JSON ``depth``."""
        if depth > MAX_JSON_DEPTH:
            return False
        if node is True:
            return self.any_value(depth)
        if node is False:
            return False
        if not isinstance(node, dict):
            raise self.error(path, f"expected a schema (an object or a boolean), got {type(node).__name__}")
        for keyword in _UNSUPPORTED:
            if keyword in node:
                raise self.error(path, f"keyword '{keyword}' is not supported by the tool-call grammar")
        out = {key: value for key, value in node.items() if key not in ("$defs", "definitions", "$id", "$schema")}
        if "$ref" in node:
            pointer = node["$ref"]
            target = self._resolve(pointer, path)
            out["$ref"] = self._define((pointer, depth), lambda: self.schema(target, depth, f"{path}/$ref"))["$ref"]
        for keyword in _COMBINATORS:
            if keyword in node:
                if not isinstance(node[keyword], list) or not node[keyword]:
                    raise self.error(path, f"keyword '{keyword}' must be a non-empty list of schemas")
                out[keyword] = [self.schema(branch, depth, f"{path}/{keyword}/{index}")
                                for index, branch in enumerate(node[keyword])]
        constrained = any(key in node for key in ("type", "enum", "const", "$ref", *_COMBINATORS))
        types = node.get("type", _ANY_TYPES if not constrained else [])
        types = [types] if isinstance(types, str) else types
        if not constrained:
            out["type"] = list(_ANY_TYPES)
        if "object" in types or any(key in node for key in ("properties", "additionalProperties", "patternProperties")):
            self._object(node, out, depth, path)
        if "array" in types or any(key in node for key in ("items", "prefixItems")):
            self._array(node, out, depth, path)
        if "number" in types or "integer" in types:
            self._number(node, out, path)
        return out

    def _object(self, node, out, depth, path):
        if "properties" in node:
            if not isinstance(node["properties"], dict):
                raise self.error(path, "keyword 'properties' must be an object of schemas")
            out["properties"] = {key: self.schema(value, depth + 1, f"{path}/properties/{key}")
                                 for key, value in node["properties"].items()}
        if "patternProperties" in node:
            out["patternProperties"] = {key: self.schema(value, depth + 1, f"{path}/patternProperties/{key}")
                                        for key, value in node["patternProperties"].items()}
        if "additionalProperties" in node:
            out["additionalProperties"] = self.schema(node["additionalProperties"], depth + 1,
                                                      f"{path}/additionalProperties")
        elif "properties" in node or "patternProperties" in node:
            # Needle's answers name only declared arguments; JSON Schema's default would let a weak
            # model wander into made-up keys.
            out["additionalProperties"] = False
        else:
            out["additionalProperties"] = self.any_value(depth + 1)

    def _array(self, node, out, depth, path):
        items = node.get("items", True)
        if isinstance(items, list):  # draft-7 tuple form
            out.pop("items")
            out["prefixItems"] = [self.schema(item, depth + 1, f"{path}/items/{index}") for index, item in enumerate(items)]
            items = node.get("additionalItems", True)
            out.pop("additionalItems", None)
        elif "prefixItems" in node:
            out["prefixItems"] = [self.schema(item, depth + 1, f"{path}/prefixItems/{index}")
                                  for index, item in enumerate(node["prefixItems"])]
        out["items"] = self.schema(items, depth + 1, f"{path}/items")

    def _number(self, node, out, path):
        for keywords, bound in ((_LOWER, -NUMBER_BOUND), (_UPPER, NUMBER_BOUND)):
            given = [keyword for keyword in keywords if keyword in node]
            for keyword in given:
                value = node[keyword]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= NUMBER_BOUND:
                    raise self.error(path, f"keyword '{keyword}' must be a number within +-{NUMBER_BOUND:g} "
                                           f"(the grammar's number range), got {value!r}")
            if not given:
                out[keywords[0]] = bound


def tool_calls_json_schema(tools: Sequence[dict], *, allow_empty: bool = True, max_calls: Optional[int] = None) -> dict:
    """JSON schema of the payload between ``<tool_call>`` and ``</tool_call>``.

    Args:
        tools: the request's tools (bare schemas or OpenAI wrappers).
        allow_empty: accept ``[]``, Needle's "no tool applies" answer.
        max_calls: at most this many calls (None: no limit).

    Returns:
        ``{"type": "array", "items": {"anyOf": [one object schema per tool]}, "$defs": {...}}``; each
        object has ``"name"`` (that tool's name, a constant) then ``"arguments"`` (the tool's
        parameters schema, bounded as `_Bounder` describes; its references point into ``$defs``).

    Raises:
        ToolGrammarError: naming the tool and the keyword, for a schema the grammar cannot enforce.
    """
    schemas = [tool_schema(tool) for tool in tools]
    names = [schema["name"] for schema in schemas]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ToolGrammarError(f"tools: names must be unique, {repeated} given more than once")
    if not schemas and not allow_empty:
        raise ToolGrammarError("tools: no tools given and allow_empty=False, so no answer is possible")
    definitions: dict = {}
    calls = []
    for index, schema in enumerate(schemas):
        bounder = _Bounder(schema["name"], schema["parameters"], definitions, prefix=f"tool{index}_")
        calls.append({
            "type": "object",
            "properties": {"name": {"const": schema["name"]},
                           "arguments": bounder.schema(schema["parameters"], _ARGUMENTS_DEPTH)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    payload = {"type": "array", "items": {"anyOf": calls}, "minItems": 0 if allow_empty else 1}
    if max_calls is not None or not calls:
        payload["maxItems"] = int(max_calls or 0) if calls else 0
    if not calls:
        del payload["items"]
    if definitions:
        payload["$defs"] = definitions
    return payload


def token_bytes(tokenizer) -> tuple[list[bytes], list[int]]:
    """The bytes of every token id of a Needle tokenizer, and the ids of its special tokens.

    Special: pad/eos/bos/unk and the chat markers (added tokens that are single ids in the vocabulary);
    their bytes are llguidance's special-token form (0xFF then the name), which no text can spell.
    """
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = tokenizer.added_tokens_decoder
    special = set(tokenizer.all_special_ids) | set(added)
    tokens = []
    for index, piece in enumerate(pieces):
        if piece is None:
            raise ToolGrammarError(f"tokenizer: id {index} has no piece (vocabulary of {size} ids expected dense)")
        byte = _BYTE_PIECE.fullmatch(piece)
        if index in special:
            # An added token's own text: newer tokenizers show a marker's piece with a leading space.
            name = added[index].content if index in added else piece
            tokens.append(_SPECIAL_PREFIX + name.encode("utf-8"))
        elif byte:
            tokens.append(bytes([int(byte.group(1), 16)]))
        else:
            tokens.append(piece.replace(SPACE_SYMBOL, " ").encode("utf-8"))
    return tokens, sorted(special)


class _PieceEncoder:
    """llguidance's view of the tokenizer: bytes per id, special ids, and text -> ids without a dummy prefix.

    llguidance tokenizes grammar fragments in the middle of a text, so the encoder runs the BPE
    model alone (spaces escaped, no normaliser, hence no dummy-prefix space).
    """

    def __init__(self, tokenizer):
        self.tokens, self.special_token_ids = token_bytes(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self._model = tokenizer.backend_tokenizer.model

    def __call__(self, text: str) -> list[int]:
        pieces = self._model.tokenize(text.replace(" ", SPACE_SYMBOL))
        return [piece.id for piece in pieces]


def marker_ids(tokenizer) -> dict[str, int]:
    """The ids of ``<tool_call>``, ``</tool_call>`` and ``<|im_end|>`` in ``tokenizer`` (each one token)."""
    markers = {}
    for marker in (TOOL_CALL_START, TOOL_CALL_END, IM_END):
        index = tokenizer.convert_tokens_to_ids(marker)
        if index is None or index == tokenizer.unk_token_id:
            raise ToolGrammarError(f"tokenizer: the chat marker {marker!r} is not a single token")
        markers[marker] = index
    return markers


def tool_calls_lark(markers: dict[str, int], tools: Sequence[dict], *, allow_empty: bool = True,
                    max_calls: Optional[int] = None) -> str:
    """The answer's grammar in llguidance's Lark dialect: markers by token id (`marker_ids`), payload by
    JSON schema (`tool_calls_json_schema` with its options).

    The answer may open with the space piece: the chat template puts one between the prompt and the
    answer, and a model trained on it writes it first. Any llguidance-backed engine that knows the
    tokenizer compiles it (vLLM's ``guidance`` structured-output backend among them).
    """
    payload = tool_calls_json_schema(tools, allow_empty=allow_empty, max_calls=max_calls)
    payload["x-guidance"] = _COMPACT_JSON
    return (
        f'start: " "? <[{markers[TOOL_CALL_START]}]> calls <[{markers[TOOL_CALL_END]}]> <[{markers[IM_END]}]>\n'
        f"calls: %json {json.dumps(payload, ensure_ascii=False)}\n"
    )


class ToolCallGrammar:
    """Builds tool-call grammars for one Needle tokenizer (the token vocabulary is read once).

    Args:
        tokenizer: a Needle `PreTrainedTokenizerFast` (markers as single added tokens, byte fallback).
        vocab_size: the model's logit width when it exceeds the tokenizer's (extra ids are never allowed).
    """

    def __init__(self, tokenizer, *, vocab_size: Optional[int] = None):
        llguidance = _require_llguidance()
        self.marker_ids = marker_ids(tokenizer)
        self.vocab_size = max(len(tokenizer), vocab_size or 0)
        self.eos_token_id = tokenizer.eos_token_id
        self._space = tokenizer.convert_tokens_to_ids(SPACE_SYMBOL)
        self.llg_tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_PieceEncoder(tokenizer)), n_vocab=self.vocab_size
        )

    def lark(self, tools: Sequence[dict], *, allow_empty: bool = True, max_calls: Optional[int] = None) -> str:
        """The request's grammar in llguidance's Lark dialect (markers by token id, payload by JSON schema).

        The answer may open with the space piece: the chat template puts one between the prompt and
        the answer, and a model trained on it writes it first.
        """
        return tool_calls_lark(self.marker_ids, tools, allow_empty=allow_empty, max_calls=max_calls)

    def matcher(self, tools: Sequence[dict], **options):
        """A fresh llguidance matcher of the request's grammar (`lark` options).

        Raises:
            ToolGrammarError: a tool whose schema cannot be compiled, named with llguidance's reason
                (which names the keyword).
        """
        llguidance = _require_llguidance()
        matcher = llguidance.LLMatcher(self.llg_tokenizer, self.lark(tools, **options), log_level=0)
        if matcher.is_error():
            for tool in tools:  # name the tool at fault
                alone = llguidance.LLMatcher(self.llg_tokenizer, self.lark([tool]), log_level=0)
                if alone.is_error():
                    raise ToolGrammarError(f"tool {_tool_name(tool)}: its parameters schema does not compile: "
                                           f"{_compile_error(alone)}")
            raise ToolGrammarError(f"tool-call grammar does not compile: {_compile_error(matcher)}")
        return matcher

    def logits_processor(self, tools: Sequence[dict], **options) -> "ToolCallLogitsProcessor":
        """A `LogitsProcessor` for one `generate()` call answering with the given tools."""
        return ToolCallLogitsProcessor(self, tools, **options)


def _compile_error(matcher) -> str:
    """llguidance's reason, without the grammar listing it appends."""
    return matcher.get_error().split("\n", 1)[0]


def allowed_tokens(matcher, vocab_size: int) -> np.ndarray:
    """Boolean [V] mask of the tokens the matcher accepts next (llguidance's bitmask unpacked)."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    mask = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
    # llguidance sizes the mask to the tokenizer's pieces; ids beyond them (a wider model) are never allowed
    return np.pad(mask, (0, vocab_size - mask.shape[0])) if mask.shape[0] < vocab_size else mask


class ToolCallLogitsProcessor:
    """Masks every token the tool-call grammar forbids; one grammar matcher per batch row.

    The processor learns the prompt length on its first call and feeds each row's matcher the tokens
    generated since. Once a row's answer is complete only EOS is allowed (after it, `generate` pads
    the row and the matcher ignores the padding). A token the grammar rejects (only possible when
    something other than this processor picks tokens) raises `ToolGrammarError`.

    Args:
        grammar: the tokenizer's `ToolCallGrammar`.
        tools: the request's tools.
        allow_empty, max_calls: see `tool_calls_json_schema`.
    """

    def __init__(self, grammar: ToolCallGrammar, tools: Sequence[dict], *, allow_empty: bool = True,
                 max_calls: Optional[int] = None):
        self.grammar = grammar
        self._template = grammar.matcher(tools, allow_empty=allow_empty, max_calls=max_calls)
        self._matchers: list = []
        self._prompt_length: Optional[int] = None
        self._seen = 0

    def _start(self, batch: int, length: int):
        self._matchers = [self._template.deep_copy() for _ in range(batch)]
        self._prompt_length = self._seen = length

    def masks(self, sequences: np.ndarray) -> np.ndarray:
        """Allowed-token mask [B, V] for the next position of ``sequences`` [B, T] (numpy, any framework)."""
        batch, length = sequences.shape
        if self._prompt_length is None or len(self._matchers) != batch or length <= self._seen:
            self._start(batch, length)  # a new generate() call
        for row, matcher in enumerate(self._matchers):
            for token in sequences[row, self._seen:length].tolist():
                if not matcher.is_stopped():  # a finished row continues with EOS, then padding
                    matcher.consume_token(int(token))
        self._seen = length
        masks = np.zeros((batch, self.grammar.vocab_size), dtype=bool)
        for row, matcher in enumerate(self._matchers):
            if matcher.is_error():
                raise ToolGrammarError(f"row {row}: the tool-call grammar rejected a token: {matcher.get_error()}")
            if matcher.is_stopped():  # the answer is complete: EOS (then generate pads the row)
                masks[row, self.grammar.eos_token_id] = True
            else:
                masks[row] = allowed_tokens(matcher, self.grammar.vocab_size)
        return masks

    def __call__(self, input_ids, scores):
        """input_ids: [B, T] torch ids; scores: [B, V] -> scores with forbidden tokens at -inf."""
        import torch

        masks = torch.from_numpy(self.masks(input_ids.detach().cpu().numpy())).to(scores.device)
        width = scores.shape[-1]
        if masks.shape[-1] < width:  # logits wider than the vocabulary: the extra ids are never allowed
            masks = torch.nn.functional.pad(masks, (0, width - masks.shape[-1]), value=False)
        return scores.masked_fill(~masks[:, :width], float("-inf"))


class FlaxToolCallLogitsProcessor:
    """`ToolCallLogitsProcessor` for Flax ``generate(..., trace=False)``: the grammar runs on the host,
    so the decoding loop must be a Python loop (a traced loop cannot call out to the matcher).

    Flax passes the whole fixed-size sequence buffer [B, max_length] and the current length.
    """

    def __init__(self, grammar: ToolCallGrammar, tools: Sequence[dict], **options):
        self._rows = ToolCallLogitsProcessor(grammar, tools, **options)

    def __call__(self, input_ids, scores, cur_len):
        import jax.numpy as jnp

        masks = self._rows.masks(np.asarray(input_ids)[:, : int(cur_len)])
        width = scores.shape[-1]
        if masks.shape[-1] < width:
            masks = np.pad(masks, ((0, 0), (0, width - masks.shape[-1])))
        return jnp.where(jnp.asarray(masks[:, :width]), scores, -jnp.inf)


__all__ = [
    "FlaxToolCallLogitsProcessor",
    "ToolCallGrammar",
    "ToolCallLogitsProcessor",
    "ToolGrammarError",
    "allowed_tokens",
    "token_bytes",
    "tool_calls_json_schema",
    "tool_schema",
]
