"""Synthetic tool-calling data of the demo model: five phone tools, templated queries, arguments
copied verbatim from the query.

Each example offers the right tool alone or beside one other tool (shuffled) and answers with one call
whose every argument value is a span of the query (the temperature as an integer). The examples
are in the Needle fine-tuning JSONL format (`needle_hf.finetune_data`), so the same rows train the
demo (`scripts/train_demo.py`) and feed the documented workflow (`examples/finetune_tools.py`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .demo import DEMO_TOOLS


#: Seeds of the demo model's training and held-out sets (scripts/train_demo.py).
DEMO_TRAIN_SEED, DEMO_HELD_OUT_SEED = 11, 12


def _tool(name: str, description: str, properties: dict) -> dict:
    """A bare tool schema whose properties are all required."""
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)}}


DEMO_DATA_TOOLS = [
    DEMO_TOOLS[0]["function"],  # set_alarm(time), the main job's tool
    _tool("send_message", "Send a text message to a contact.",
          {"to": {"type": "string", "description": "Name of the contact."},
           "text": {"type": "string", "description": "Text to send."}}),
    _tool("play_music", "Play a song.", {"song": {"type": "string", "description": "Song title."}}),
    _tool("set_temperature", "Set the thermostat.",
          {"degrees": {"type": "integer", "description": "Target temperature in Celsius."}}),
    _tool("get_weather", "Get the weather forecast for a city.", {"city": {"type": "string"}}),
]

CONTACTS = ("Alice", "Bob", "Grace", "Hiroshi", "Fatima", "Dmitri", "Emma", "Lucas", "Mia", "Noah", "Sara", "Tom")
MESSAGES = ("I'm running late", "see you soon", "call me back", "dinner is ready", "happy birthday",
             "the meeting moved to Thursday", "on my way", "thanks for the help")
SONGS = ("Yesterday", "Hey Jude", "Bohemian Rhapsody", "Imagine", "Hotel California", "Wonderwall",
          "Let It Be", "Clocks", "Yellow", "Halo", "Africa", "Dancing Queen")
CITIES = ("Paris", "Tokyo", "New York", "Berlin", "Lagos", "Lima", "Seoul", "Madrid", "Rome", "Cairo",
           "Sydney", "Toronto")

# Query templates per tool; the slots are the tool's argument names.
QUERY_TEMPLATES = {
    "set_alarm": ("Wake me up at {time} tomorrow.", "Set an alarm for {time}.", "Alarm at {time} please.",
                  "Can you wake me at {time}?", "I need an alarm at {time}."),
    "send_message": ("Text {to} that {text}.", "Send a message to {to} saying {text}.",
                     "Tell {to} {text}.", "Message {to}: {text}."),
    "play_music": ("Play {song}.", "Put on {song}.", "I want to hear {song}.", "Can you play {song}?"),
    "set_temperature": ("Set the temperature to {degrees} degrees.", "Make it {degrees} degrees in here.",
                        "Change the thermostat to {degrees}.", "Heat the house to {degrees} degrees."),
    "get_weather": ("What's the weather in {city}?", "Weather forecast for {city}.",
                    "Will it rain in {city} today?", "How hot is it in {city}?"),
}


def _arguments(name: str, rng: random.Random) -> dict:
    """Random arguments of tool ``name``; each value appears verbatim in the query."""
    if name == "set_alarm":
        return {"time": f"{rng.randrange(24)}:{rng.choice((0, 5, 10, 15, 20, 30, 40, 45, 50)):02d}"}
    if name == "send_message":
        return {"to": rng.choice(CONTACTS), "text": rng.choice(MESSAGES)}
    if name == "play_music":
        return {"song": rng.choice(SONGS)}
    if name == "set_temperature":
        return {"degrees": rng.randrange(16, 29)}
    return {"city": rng.choice(CITIES)}


def make_demo_examples(count: int, *, seed: int) -> list[dict]:
    """``count`` examples {"tools", "query", "answers"} drawn with ``seed`` (reproducible)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        target = rng.randrange(len(DEMO_DATA_TOOLS))
        others = [index for index in range(len(DEMO_DATA_TOOLS)) if index != target]
        offered = [target, *rng.sample(others, rng.randrange(2))]
        rng.shuffle(offered)
        name = DEMO_DATA_TOOLS[target]["name"]
        arguments = _arguments(name, rng)
        query = rng.choice(QUERY_TEMPLATES[name]).format(**arguments)
        examples.append({"tools": [DEMO_DATA_TOOLS[index] for index in offered], "query": query,
                         "answers": [{"name": name, "arguments": arguments}]})
    return examples


def write_demo_jsonl(path, count: int, *, seed: int) -> Path:
    """Write ``count`` demo examples to a fine-tuning JSONL file and return its path."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as handle:
        for example in make_demo_examples(count, seed=seed):
            handle.write(json.dumps(example, ensure_ascii=False) + "\n")
    return path
