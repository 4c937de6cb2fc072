"""The shipped demo checkpoint (needle_hf/demo/) for the suites: its paths, a safe load, the tool-calling
prompts it answers, and the `demo_folder` fixture (the demo as a Hugging Face folder).

The transformers 5 venv runs the source tree, where `needle_hf.conversion` (installed from the
folder `conversion/`) is not a subpackage: there the converter is replaced by building the folder
from the public pieces, and the safe checkpoint loader is imported from `conversion` itself.
"""

from pathlib import Path

import numpy as np
import pytest
from transformers import GenerationConfig

from needle_hf.models.needle.configuration_needle import NeedleConfig
from needle_hf.demo import DEMO_DIR
from needle_hf.models.needle.tokenization_needle import build_fast_tokenizer, save_fast_tokenizer
from needle_hf.models.needle.weight_names import native_to_hf, optional_heads_in_native

DEMO_CHECKPOINT = DEMO_DIR / "needle2-demo.pkl"
DEMO_TOKENIZER = DEMO_DIR / "tokenizer.model"
MAX_NEW_TOKENS = 48


def load_demo_checkpoint():
    """The demo checkpoint through the project's safe loader (`load_native_checkpoint`), never `pickle.load`."""
    try:
        from needle_hf.conversion.native_checkpoint import load_native_checkpoint
    except ImportError:  # the transformers 5 venv runs the source tree: the folder is the package there
        from conversion.native_checkpoint import load_native_checkpoint
    return load_native_checkpoint(DEMO_CHECKPOINT)


def _tool(name, description, properties):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)}}}


# The demo data set's tools, written here as a user would (OpenAI wrappers), in the same words.
SET_ALARM = _tool("set_alarm", "Set an alarm on the phone.",
                  {"time": {"type": "string", "description": "HH:MM, 24-hour clock"}})
SEND_MESSAGE = _tool("send_message", "Send a text message to a contact.",
                     {"to": {"type": "string", "description": "Name of the contact."},
                      "text": {"type": "string", "description": "Text to send."}})
PLAY_MUSIC = _tool("play_music", "Play a song.", {"song": {"type": "string", "description": "Song title."}})
SET_TEMPERATURE = _tool("set_temperature", "Set the thermostat.",
                        {"degrees": {"type": "integer", "description": "Target temperature in Celsius."}})

# (tools offered, query, the tool the answer must call)
TOOL_QUERIES = [
    ([SET_ALARM], "Set an alarm for 6:45.", "set_alarm"),
    ([PLAY_MUSIC, SEND_MESSAGE], "Text Alice that I'm running late.", "send_message"),
    ([SET_TEMPERATURE], "Set the temperature to 21 degrees.", "set_temperature"),
    ([PLAY_MUSIC], "Play Yesterday.", "play_music"),
]


def build_folder_without_converter(out_dir: Path):
    """The converter's output (config, generation config, weights, tokenizer) from its public parts."""
    from safetensors.numpy import save_file

    checkpoint = load_demo_checkpoint()
    config = NeedleConfig.from_needle_config(checkpoint.config, **optional_heads_in_native(checkpoint.params))
    config.architectures = ["NeedleForCausalLM"]
    tensors = native_to_hf(checkpoint.params, config)
    out_dir.mkdir(parents=True)
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)
    save_file({name: np.asarray(value, np.float32) for name, value in tensors.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    save_fast_tokenizer(build_fast_tokenizer(str(DEMO_TOKENIZER), model_max_length=config.max_position_embeddings),
                        str(out_dir))


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    """The demo checkpoint as a Hugging Face folder (converted once per module)."""
    out_dir = tmp_path_factory.mktemp("pipeline") / "needle2-demo-hf"
    try:
        from needle_hf.conversion.convert import convert
    except ImportError:  # transformers 5 venv: the converter (Flax verification) is not installed there
        build_folder_without_converter(out_dir)
    else:
        convert(DEMO_CHECKPOINT, out_dir, tokenizer=DEMO_TOKENIZER)
    return out_dir
