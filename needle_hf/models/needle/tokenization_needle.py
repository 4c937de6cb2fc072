"""The Needle tokenizer as a Hugging Face fast tokenizer: build, save, check, register.

`build_fast_tokenizer` wraps the conversion of `sentencepiece_needle` (how SentencePiece's
behaviour maps onto the `tokenizers` pipeline; the piece table of a `.model` file or a `.cact`
export) in `NeedleTokenizerFast`. `save_fast_tokenizer` writes a folder whose tokenizer_config.json
names the plain `PreTrainedTokenizerFast`, so `AutoTokenizer` loads it without this package and
without remote code, with the chat template, the special tokens and (for transformers 5.13+) the
`response_template` that parses answers. The conversion's names are importable from here too.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

from .chat_template import NEEDLE_CHAT_TEMPLATE
from .response_template import RESPONSE_TEMPLATE
from .sentencepiece_needle import (  # noqa: F401  (the conversion's names, importable from here)
    BOS_ID,
    EOS_ID,
    MARKER_MATCH_PREFIX,
    NUM_BYTE_PIECES,
    PAD_ID,
    SPACE_SYMBOL,
    UNK_ID,
    NeedleTokenizerConverter,
    PieceTable,
    PieceType,
    TokenizerSourceError,
    TokenizerVocabMismatchError,
    _as_piece_table,
    _check_prompt_target_boundary,
    sentencepiece_tokenizer_settings,
)

# What a saved folder names: transformers' own class, so loading it needs neither needle_hf nor remote code.
_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def build_fast_tokenizer(source, *, model_max_length=None, chat_template=NEEDLE_CHAT_TEMPLATE):
    """Build the Needle tokenizer as a `NeedleTokenizerFast` (a `transformers.PreTrainedTokenizerFast`).

    Args:
        source: a SentencePiece `.model` path, a `PieceTable`, or a parsed `.cact` piece-table
            mapping (see `PieceTable.from_mapping`).
        model_max_length: the model's context length (e.g. 2048), stored in the tokenizer config.
        chat_template: the Jinja chat template to attach (defaults to Needle's prompt format;
            with it, a vocabulary on which the template cannot match the reference is refused).

    Returns:
        A `NeedleTokenizerFast` that encodes like SentencePiece with BOS prepended, with the
        pad/eos/bos/unk tokens set, the chat template and `response_template` attached. Save it
        with `save_fast_tokenizer`, which writes a folder `AutoTokenizer` loads without remote code.
    """
    from .tokenization_needle_fast import NeedleTokenizerFast

    tokenizer_object, settings = sentencepiece_tokenizer_settings(source, chat_template=chat_template)
    extra = {} if model_max_length is None else {"model_max_length": int(model_max_length)}
    tokenizer = NeedleTokenizerFast(tokenizer_object=tokenizer_object, **settings, **extra)
    # An attribute on 4.57 too (where nothing reads it), so both versions save and compare the same tokenizer.
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def save_fast_tokenizer(tokenizer, save_directory):
    """`save_pretrained` the tokenizer as a folder transformers 4.57 and 5.x load with no remote code.

    tokenizer_config.json names `PreTrainedTokenizerFast` (whatever class name the release writes,
    and no `auto_map`), and holds the `response_template` (read by transformers 5.13+). The chat
    template, the special tokens and the turn markers' special flag travel as `save_pretrained`
    writes them. (transformers 5.x's own `save_pretrained` of a plain fast tokenizer names
    `TokenizersBackend`, a class 4.57 does not have: save through here to keep a folder both load.)

    Args:
        tokenizer: the Needle tokenizer as a fast tokenizer: `build_fast_tokenizer`'s
            `NeedleTokenizerFast`, or a folder's tokenizer loaded with `AutoTokenizer`.
        save_directory: the folder to write.

    Returns:
        The paths of the written files, as `save_pretrained` returns them.
    """
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"save_fast_tokenizer: expected a fast tokenizer (build_fast_tokenizer builds one), "
                        f"got {type(tokenizer).__name__}")
    written = tokenizer.save_pretrained(save_directory)
    config_path = os.path.join(save_directory, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    wanted = dict(config, tokenizer_class=_TOKENIZER_CLASS, response_template=RESPONSE_TEMPLATE)
    wanted.pop("auto_map", None)
    if wanted != config:
        config = wanted
        with open(config_path, "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, ensure_ascii=False, allow_nan=False)
            handle.write("\n")
    return written


# A tokenizer.json far larger than Needle's (about 0.5 MB) is not one.
MAX_TOKENIZER_JSON_BYTES = 64 << 20


def read_tokenizer_file(path):
    """Read a `tokenizer.json` into a `tokenizers.Tokenizer`, or raise `TokenizerSourceError` naming it.

    The file is parsed as JSON first (bounded in size; nesting beyond Python's recursion limit is
    an error), so a damaged file gets one clear message rather than the library's own error.
    """
    size = os.path.getsize(path)
    if size > MAX_TOKENIZER_JSON_BYTES:
        raise TokenizerSourceError(f"{path}: {size} bytes, more than a tokenizer.json holds ({MAX_TOKENIZER_JSON_BYTES})")
    try:
        with open(path, "rb") as handle:
            text = handle.read().decode("utf-8")
        content = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise TokenizerSourceError(f"{path}: not valid JSON ({type(error).__name__}: {str(error)[:80]})") from None
    if not isinstance(content, dict) or not isinstance(content.get("model"), dict):
        raise TokenizerSourceError(f"{path}: expected a tokenizer.json object with a 'model' entry")
    try:
        return Tokenizer.from_str(text)
    except Exception as error:  # the library raises a bare Exception for any malformed field
        message = " ".join(str(error).split())[:160]
        raise TokenizerSourceError(f"{path}: not a readable tokenizer.json ({message})") from None


def check_vocab_matches(tokenizer, vocab_size, *, source="the model config"):
    """Raise `TokenizerVocabMismatchError` unless the tokenizer has exactly `vocab_size` ids.

    Args:
        tokenizer: a transformers tokenizer (its `len()` counts every id, added tokens included).
        vocab_size: the embedding rows the model has.
        source: where `vocab_size` came from, for the message.
    """
    found = len(tokenizer)
    if found != vocab_size:
        raise TokenizerVocabMismatchError(
            f"tokenizer has {found} ids but {source} has vocab_size {vocab_size}; "
            "the tokenizer and the weights must come from the same Needle checkpoint")


def register_tokenizer_class():
    """Map `NeedleConfig` to `NeedleTokenizerFast` in `AutoTokenizer` (transformers 4.57 and 5.x).

    Folders written by `save_fast_tokenizer` name `PreTrainedTokenizerFast`, which `AutoTokenizer`
    honours; the mapping serves folders without a `tokenizer_class` and older folders that name
    `NeedleTokenizerFast` (found among the registered classes, no `trust_remote_code`).
    """
    from transformers import AutoTokenizer

    from .configuration_needle import NeedleConfig
    from .tokenization_needle_fast import NeedleTokenizerFast

    AutoTokenizer.register(NeedleConfig, fast_tokenizer_class=NeedleTokenizerFast, exist_ok=True)
