"""Synthetic tool-calling data of the demo model: five phone tools, templated queries, arguments
copied verbatim from the query.

Each example offers the right tool alone or beside one other tool (shuffled) and answers with one call
whose every argument value is a span of the query (the temperature as an integer). The examples
are in the Needle fine-tuning JSONL format (`needle_hf.finetune.data`), so the same rows train the
demo (`scripts/train_demo.py`) and feed the documented workflow (`examples/finetune_tools.py`).

Held-out prompts: ``split="held_out"`` draws only queries that ``split="train"`` never draws (a fixed
fifth of the query strings, chosen by a hash), so every template and every slot value is seen in
training but no held-out query is. `DISTRACTOR_TOOLS` are phone tools no query asks for: the
routing catalogue of the contrastive head (trained on the first `TRAINING_DISTRACTORS`, measured
on all of them). `corrupt_demo_answers` makes the wrong answers the confidence head learns to
doubt.
"""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path
from typing import Optional

from . import DEMO_TOOLS


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


def is_held_out_query(query: str) -> bool:
    """Whether ``query`` belongs to the held-out split (a fixed fifth of all query strings)."""
    return zlib.crc32(query.encode("utf-8")) % 5 == 0


def make_demo_examples(count: int, *, seed: int, split: Optional[str] = None) -> list[dict]:
    """``count`` examples {"tools", "query", "answers"} drawn with ``seed`` (reproducible).

    ``split``: None draws from every query; "train" never draws a held-out query
    (`is_held_out_query`), "held_out" draws only those.
    """
    if split not in (None, "train", "held_out"):
        raise ValueError(f"split: expected None, 'train' or 'held_out', got {split!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count: expected an int >= 0, got {count!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    rng = random.Random(seed)
    examples = []
    while len(examples) < count:
        target = rng.randrange(len(DEMO_DATA_TOOLS))
        others = [index for index in range(len(DEMO_DATA_TOOLS)) if index != target]
        offered = [target, *rng.sample(others, rng.randrange(2))]
        rng.shuffle(offered)
        name = DEMO_DATA_TOOLS[target]["name"]
        arguments = _arguments(name, rng)
        query = rng.choice(QUERY_TEMPLATES[name]).format(**arguments)
        if split is not None and is_held_out_query(query) != (split == "held_out"):
            continue
        examples.append({"tools": [DEMO_DATA_TOOLS[index] for index in offered], "query": query,
                         "answers": [{"name": name, "arguments": arguments}]})
    return examples


# Tools no demo query asks for: negatives of the routing catalogue. The training catalogue holds the
# first TRAINING_DISTRACTORS; the rest are seen only when recall is measured.
DISTRACTOR_TOOLS = [
    _tool("set_timer", "Start a countdown timer.", {"minutes": {"type": "integer", "description": "Length in minutes."}}),
    _tool("call_contact", "Place a phone call to a contact.", {"name": {"type": "string", "description": "Contact to call."}}),
    _tool("turn_on_lights", "Switch on the lights in a room.", {"room": {"type": "string"}}),
    _tool("create_reminder", "Create a reminder.", {"text": {"type": "string"}, "date": {"type": "string"}}),
    _tool("get_news", "Read the latest headlines on a topic.", {"topic": {"type": "string"}}),
    _tool("book_taxi", "Book a taxi to a destination.", {"destination": {"type": "string"}}),
    _tool("set_volume", "Set the speaker volume.", {"level": {"type": "integer", "description": "0 to 100."}}),
    _tool("take_photo", "Take a photo with the camera.", {"camera": {"type": "string", "enum": ["front", "back"]}}),
    _tool("translate_text", "Translate a text into another language.",
          {"text": {"type": "string"}, "language": {"type": "string"}}),
    _tool("search_web", "Search the web.", {"query": {"type": "string"}}),
    _tool("add_calendar_event", "Add an event to the calendar.", {"title": {"type": "string"}, "date": {"type": "string"}}),
    _tool("get_directions", "Get driving directions to a place.", {"destination": {"type": "string"}}),
    _tool("order_food", "Order a dish for delivery.", {"dish": {"type": "string"}}),
    _tool("check_battery", "Report the battery level.", {}),
    _tool("open_app", "Open an app on the phone.", {"app": {"type": "string"}}),
    _tool("pause_music", "Pause the music that is playing.", {}),
]
TRAINING_DISTRACTORS = 8


def corrupt_demo_answers(example: dict, rng: random.Random) -> list[dict]:
    """A wrong version of ``example``'s answers: another tool, one argument changed, or one dropped.

    The kind is drawn with ``rng``; the result always differs from the right answers.
    """
    (call,) = example["answers"]
    kind = rng.choice(("wrong tool", "wrong argument", "missing argument"))
    if kind == "wrong tool":
        offered = [tool["name"] for tool in example["tools"] if tool["name"] != call["name"]]
        others = offered or [tool["name"] for tool in DEMO_DATA_TOOLS if tool["name"] != call["name"]]
        name = rng.choice(others)
        return [{"name": name, "arguments": _arguments(name, rng)}]
    arguments = dict(call["arguments"])
    key = rng.choice(sorted(arguments))
    if kind == "missing argument":
        del arguments[key]
    else:
        while arguments[key] == call["arguments"][key]:
            arguments[key] = _arguments(call["name"], rng)[key]
    return [{"name": call["name"], "arguments": arguments}]


def write_demo_jsonl(path, count: int, *, seed: int) -> Path:
    """Write ``count`` demo examples to a fine-tuning JSONL file and return its path."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected an int >= 1, got {count!r}")
    examples = make_demo_examples(count, seed=seed)
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"{path}: its folder {path.parent} does not exist")
    if path.is_dir():
        raise ValueError(f"{path}: a folder; expected a file path")
    with path.open("w", encoding="utf-8") as handle:
        for example in examples:
            handle.write(json.dumps(example, ensure_ascii=False, allow_nan=False) + "\n")
    return path
