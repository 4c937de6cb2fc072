"""Synthetic fine-tuning data for a smart-home app: five tools, every category an acceptance suite scores.

The app is the one the reference's `smart_home` acceptance suite describes: lights, thermostat,
fans, blinds and a robot vacuum in a home with a kitchen, a living room, a bedroom and a study.
`SMART_HOME_TOOLS` are this module's own definitions of those five tools (same names, argument
types, enums and bounds; the descriptions are ours), so the data can be made without the reference
installed. Training should still offer the schemas the app will send at run time
(`scripts/train_smart_home.py` renders the installed suite's own tool list when it is there): the
prompt is the model's input and its wording matters.

Each example is one line of the Needle fine-tuning JSONL format (`needle_hf.finetune.data`):
``{"query", "tools", "answers", "system"}``, in one of six categories (`CATEGORIES`):

    positive    one supported action, every required argument stated; optional arguments
                (brightness, color, fan speed, vacuum room) only when the query states them
    parallel    two supported actions in one query (joined by "and", "then", "also", ...): two calls
    missing     an action whose target or value is not stated (which room? what temperature?): no call
    irrelevant  a device or service the app does not have, or a question about state: no call
    negation    an action the user says not to do: no call
    invalid     a value the tools refuse (brightness over 100, temperature outside 10-30, a room
                the device is not in, a colour the lights do not have): no call

Queries are built from our own templates and vocabularies (verbs, word orders, fillers, politeness
forms), numbers written as digits. Every query carries a request frame (a greeting, a politeness
form or a closing word; a full one around a short command), so the data never repeats a bare
suite-style command word for word. The categories share their surface forms: a missing-room request
is a positive's verb and word order with the room taken out (`_roomless`), and a request for another
app's device may name a room, so no wording alone tells a call from no call.

Held-out split: `is_held_out_query` puts a fixed fifth of the query strings (by CRC-32) aside;
``split="held_out"`` draws only those and ``split="train"`` never does.
"""

from __future__ import annotations

import random
import zlib
from typing import Annotated, Literal, Optional

from ..sdk.tools_schema import Field, tool, tool_schema_of

#: The categories an app suite scores, in the order the examples cycle through them.
CATEGORIES = ("positive", "parallel", "missing", "irrelevant", "negation", "invalid")
#: Share of each category in the generated data (positives and parallels carry most of the calls to learn).
CATEGORY_WEIGHTS = {"positive": 0.40, "parallel": 0.16, "missing": 0.12, "irrelevant": 0.12, "negation": 0.08,
                    "invalid": 0.12}
#: Seeds of the training and held-out sets of `scripts/train_smart_home.py`.
TRAIN_SEED, HELD_OUT_SEED = 31, 32

#: Our system text for the app (the training data also uses the app's own, see the training script).
SYSTEM_TEXTS = (
    "You control a home's lights, thermostat, fans, blinds and robot vacuum. Make one call per requested "
    "action. If a room or value is not given, a device is not supported, a value is out of range, or the "
    "user says not to do something, make no call.",
    "Home assistant: call a tool only for a clear, supported request with every needed detail. "
    "No call for unsupported devices, bad values, negated or vague requests.",
)

Room = Literal["kitchen", "living_room", "bedroom", "study"]


@tool
def control_lights(
    room: Room,
    action: Literal["on", "off", "dim"],
    brightness_percent: Annotated[Optional[int], Field(ge=0, le=100)] = None,
    color: Optional[Literal["warm white", "cool white", "red", "green", "blue"]] = None,
):
    """Switch a room's lights on or off, dim them to a percentage, or change their colour.

    Args:
        room: Which room.
        action: on, off or dim.
        brightness_percent: Brightness, 0 to 100, only when a number is given.
        color: Light colour, only when one is named.
    """


@tool
def set_thermostat(temperature: Annotated[int, Field(ge=10, le=30)]):
    """Set the thermostat's target temperature in degrees Celsius.

    Args:
        temperature: Target in degrees Celsius.
    """


@tool
def control_fan(
    room: Literal["living_room", "bedroom", "study"],
    action: Literal["on", "off"],
    speed: Optional[Literal["low", "medium", "high"]] = None,
):
    """Switch a room's fan on or off, at a speed when one is given.

    Args:
        room: Which room.
        action: on or off.
        speed: Fan speed, only when stated.
    """


@tool
def control_blinds(room: Room, action: Literal["open", "close"]):
    """Open or close the blinds of one named room.

    Args:
        room: Which room.
        action: open or close.
    """


@tool
def start_robot_vacuum(
    action: Literal["start", "stop", "dock"],
    room: Optional[Literal["kitchen", "living_room", "bedroom"]] = None,
):
    """Start, stop or dock the robot vacuum.

    Args:
        action: start, stop or dock.
        room: Room to clean, only when a start names one.
    """


SMART_HOME_FUNCTIONS = [control_lights, set_thermostat, control_fan, control_blinds, start_robot_vacuum]
#: The five tool schemas as `needle_hf.Needle` renders them.
SMART_HOME_TOOLS = [tool_schema_of(function) for function in SMART_HOME_FUNCTIONS]

ROOMS = ("kitchen", "living_room", "bedroom", "study")
FAN_ROOMS = ("living_room", "bedroom", "study")
VACUUM_ROOMS = ("kitchen", "living_room", "bedroom")
COLORS = ("warm white", "cool white", "red", "green", "blue")
SPEEDS = ("low", "medium", "high")
# Rooms and colours the home does not have (invalid values).
OTHER_ROOMS = ("garage", "bathroom", "attic", "hallway", "basement", "nursery", "guest room", "dining room",
               "laundry room", "porch")
OTHER_COLORS = ("purple", "orange", "pink", "yellow", "magenta", "teal", "violet", "amber")

ROOM_WORDS = {"kitchen": ("kitchen",), "living_room": ("living room", "lounge"), "bedroom": ("bedroom",),
              "study": ("study",)}

# Request frames: every query gets one (prefix, suffix or both), so no query is a bare command.
PREFIXES = ("could you please ", "can you please ", "hey there, ", "okay then, ", "would you please ",
            "i'd like you to ", "go ahead and ", "quick one: ", "hi, please ", "alright, please ",
            "hello, could you ", "would you kindly ", "if you can, ", "help me out and ", "i need you to ")
SUFFIXES = (" for me please", " now please", " right now thanks", " when you can", ", thank you so much",
            " please and thanks", ", cheers mate", " if you would", " whenever you get a chance",
            " as soon as possible")

# Light templates: {room} a room phrase, {act} the verb phrase of the action.
LIGHT_ON_VERBS = ("turn on", "switch on", "put on", "flip on", "light up")
LIGHT_OFF_VERBS = ("turn off", "shut off", "kill", "put out", "cut")
LIGHT_TEMPLATES = ("{verb} the lights in the {room}", "{verb} all the {room} lights", "{verb} the {room} lighting",
                   "{verb} the lamps in the {room}", "{verb} the {room} lamps")
LIGHT_SPLIT_TEMPLATES = ("{v1} the {room} lights {v2}", "{v1} the lights in the {room} {v2}",
                         "{room} lights {v2}", "lights {v2} in the {room}")
SPLIT_VERBS = {"on": (("turn", "on"), ("switch", "on"), ("put", "on")),
               "off": (("turn", "off"), ("switch", "off"), ("put", "off"))}
DIM_TEMPLATES = ("dim the {room} lights to {n}%", "dim the lights in the {room} to {n} percent",
                 "bring the {room} lights down to {n} percent", "lower the {room} lighting to {n}%",
                 "set the {room} lights to {n} percent brightness", "{room} lights at {n} percent",
                 "turn the {room} lights down to {n}%", "make the {room} lights {n} percent bright",
                 "set the {room} brightness to {n} percent", "put the {room} lights at {n}%",
                 "{room} brightness {n} percent", "lights in the {room} at {n} percent")
COLOR_TEMPLATES = ("make the {room} lights {color}", "set the {room} lights to {color}",
                   "change the lights in the {room} to {color}", "switch the {room} lights to {color}",
                   "{color} lights in the {room}", "turn the {room} lamps {color}",
                   "I want {color} light in the {room}")
COLOR_TAILS = (" in {color}", " with {color} light", ", {color} please", " and make them {color}", " set to {color}")
THERMOSTAT_TEMPLATES = ("set the temperature to {n}", "put the heating at {n} degrees", "make it {n} degrees in here",
                        "change the thermostat to {n}", "thermostat at {n} degrees", "heat the place up to {n} degrees",
                        "bring the temperature down to {n} degrees", "adjust the thermostat to {n} celsius",
                        "I want it {n} degrees inside", "raise the heat to {n}", "drop the thermostat to {n} degrees",
                        "keep the house at {n} degrees", "set the heat to {n} c")
# Fan and blinds: every verb meets every word order, so the order never tells the direction.
FAN_VERBS = {"on": ("switch on", "start", "put on", "power up", "start up"),
             "off": ("switch off", "turn off", "stop", "shut off", "kill", "power down")}
FAN_FORMS = ("{verb} the fan in the {room}", "{verb} the {room} fan", "{verb} the ceiling fan in the {room}")
FAN_SPLIT_TEMPLATES = ("turn the {room} fan {kind}", "flip the {room} fan {kind}", "put the {room} fan {kind}",
                       "switch the fan in the {room} {kind}", "{room} fan {kind}")
FAN_SPEED_TEMPLATES = ("turn the {room} fan on {speed}", "set the fan in the {room} to {speed}",
                       "start the {room} fan at {speed} speed", "{room} fan on {speed} speed",
                       "run the fan in the {room} at {speed}", "switch on the {room} fan on {speed}",
                       "put the ceiling fan in the {room} on {speed}", "{speed} speed for the {room} fan")
BLIND_VERBS = {"open": ("raise", "pull up", "roll up", "lift"),
               "close": ("lower", "pull down", "roll down", "shut", "draw")}
BLIND_FORMS = ("{verb} the {room} blinds", "{verb} the blinds in the {room}", "{verb} the blinds of the {room}",
               "{verb} the {room} window blinds", "{verb} all the blinds in the {room}")
# The plain verbs, each in word orders the other direction also uses.
BLIND_PLAIN_TEMPLATES = {"open": ("open the blinds in the {room}", "open the blinds of the {room}",
                                  "open the {room} window blinds",
                                  "let some light into the {room}, open the blinds"),
                         "close": ("close the {room} blinds", "close the {room} window blinds",
                                   "keep the light out of the {room}, close the blinds")}
BLIND_SHORT_TEMPLATES = {"open": ("{room} blinds up", "{room} blinds open", "blinds up in the {room}"),
                         "close": ("{room} blinds down", "{room} blinds closed", "blinds down in the {room}")}
VACUUM_START_TEMPLATES = ("get the vacuum going", "start a cleaning run", "send the robot vacuum out",
                          "begin vacuuming", "kick off the vacuum")
# Every verb of an action meets every way of naming the vacuum, and stopping is asked as often as starting.
VACUUM_VERBS = {"start": ("run", "start up", "switch on", "power up", "set off"),
                "stop": ("halt", "pause", "switch off", "power down", "shut off", "turn off", "end", "stop"),
                "dock": ("dock", "park", "recharge", "send home")}
VACUUM_FORMS = ("{verb} the vacuum", "{verb} the robot vacuum cleaner", "{verb} the robot hoover",
                "{verb} the cleaning robot", "{verb} the vacuum robot")
# A room named anywhere in a vacuum request goes into the call.
VACUUM_ROOM_TEMPLATES = ("vacuum the {room}", "send the vacuum to clean the {room}", "run the robot vacuum in the {room}",
                         "clean the {room} with the robot vacuum", "have the vacuum do the {room}",
                         "begin vacuuming the {room}", "get the vacuum cleaning the {room}",
                         "start the robot vacuum in the {room}", "start a cleaning run in the {room}",
                         "kick off vacuuming in the {room}", "do some vacuuming in the {room}",
                         "get the {room} vacuumed", "run a vacuum through the {room}",
                         "the {room} needs vacuuming, start the robot")
VACUUM_STOP_TEMPLATES = ("stop vacuuming", "make the vacuum stop", "that's enough vacuuming, stop it",
                         "the vacuum can stop now", "cancel the cleaning run", "call off the vacuuming")
VACUUM_DOCK_TEMPLATES = ("send the vacuum back to its dock", "dock the robot vacuum", "return the vacuum to the charger",
                         "put the vacuum back on its base", "let the robot vacuum recharge at the dock")

# Missing arguments: the action is supported, the target or the value is not given.
MISSING_TEMPLATES = ("switch on the lights", "lights off", "turn the lamps on", "dim the lights",
                     "put the lights on", "make the lights blue", "change the light colour",
                     "adjust the thermostat", "change the temperature", "make it warmer", "make it cooler in here",
                     "set the heating", "turn the heat up a bit", "set the thermostat to a nice level",
                     "raise the blinds", "close the blinds", "pull the blinds down", "shut the blinds",
                     "switch the fan off", "start the fan", "put a fan on", "fan on high", "turn off the fan",
                     "set the fan to medium", "dim the {room} lights a little", "open some blinds",
                     "open the curtains somewhere")
# Requests for devices and services the home does not have, with and without a room named.
OTHER_APP_REQUESTS = ("play some music", "put on a podcast", "turn on the radio", "start the tv", "turn the speaker up",
                      "put on the news", "open the window", "lock the window", "turn on the humidifier",
                      "switch on the air purifier", "start the heated floor", "play a movie", "set up the projector",
                      "put some jazz on", "turn on the space heater", "run the dehumidifier")
OTHER_APP_ROOM_FORMS = ("{request} in the {room}", "{request} for the {room}", "in the {room}, {request}",
                        "{request} over in the {room}")
IRRELEVANT_TEMPLATES = ("lock the front door", "unlock the garage door", "play some music in the {room}",
                        "turn on the tv", "what's the weather tomorrow", "order more coffee pods",
                        "preheat the oven to 200 degrees", "start the dishwasher", "set an alarm for 7",
                        "call mom", "is the {room} fan running", "what temperature is it inside",
                        "arm the security system", "water the garden", "show me the doorbell camera",
                        "how much battery does the vacuum have", "is the vacuum docked", "add milk to the list",
                        "turn on the sprinklers", "open the garage", "start the washing machine",
                        "read me the news", "which lights are on", "what is the thermostat set to",
                        "tell me a joke", "turn up the volume", "book a table for 2", "brew some coffee",
                        "are the {room} blinds open", "turn on the hot tub", "feed the cat",
                        "switch on the kettle", "empty the vacuum bin")
# Questions about a device's state: the tools only act, so no call.
STATE_QUESTION_FRAMES = ("check whether {state}", "tell me if {state}", "see if {state}", "find out whether {state}",
                         "let me know if {state}", "can you check if {state}", "i wonder if {state}")
STATES = ("the vacuum is docked", "the robot vacuum is still cleaning", "the vacuum battery is low",
          "the vacuum is on its charger", "the vacuum has finished the {room}", "the {room} lights are on",
          "the {room} blinds are open", "the {room} blinds are down", "the {fan_room} fan is running",
          "the heating is on", "the thermostat is above {n} degrees", "the {fan_room} fan is on high")
NEGATION_TEMPLATES = ("don't {action}", "do not {action}", "never {action}", "no need to {action}",
                      "please don't {action}", "just don't {action}", "do not {action} tonight",
                      "don't {action} yet", "never {action} when i'm asleep", "no need to {action} today")
NEGATION_ACTIONS = ("switch off the {room} lights", "turn on the lights in the {room}", "raise the blinds in the {room}",
                    "lower the {room} blinds", "change the thermostat to {n}", "start the vacuum cleaner",
                    "vacuum the {room}", "turn the {fan_room} fan on", "dim the {room} lights to {p}%",
                    "make the {room} lights {color}", "dock the vacuum", "switch off the {fan_room} fan")
INVALID_TEMPLATES = (
    ("bring the {room} lights down to {bad_p} percent", "bad_brightness"),
    ("set the {room} lights to {bad_p}% brightness", "bad_brightness"),
    ("set the temperature to {bad_t}", "bad_temperature"),
    ("make it {bad_t} degrees in here", "bad_temperature"),
    ("put the heating at {bad_t} degrees", "bad_temperature"),
    ("switch on the lights in the {other_room}", "bad_room"),
    ("open the {other_room} blinds", "bad_room"),
    ("turn the {other_room} fan on", "bad_room"),
    ("turn the kitchen fan on", "bad_room"),
    ("vacuum the study", "bad_room"),
    ("run the robot vacuum in the {other_room}", "bad_room"),
    ("begin vacuuming the study", "bad_room"),
    ("start the robot vacuum in the {other_room}", "bad_room"),
    ("make the {room} lights {other_color}", "bad_color"),
    ("set the lights in the {room} to {other_color}", "bad_color"),
)
PARALLEL_JOINERS = (" and ", " and then ", ", then ", ", also ", " and also ", "; ", ", and ")


def is_held_out_query(query: str) -> bool:
    """The fixed fifth of query strings kept for the held-out split (by CRC-32 of the text)."""
    return zlib.crc32(query.encode("utf-8")) % 5 == 0


def _room_text(room: str, rng: random.Random) -> str:
    return rng.choice(ROOM_WORDS[room])


#: Cores shorter than this always get a full frame (a bare "please" around them is nearly a bare command).
SHORT_CORE = 24


def _frame(core: str, rng: random.Random) -> str:
    """``core`` inside a request frame: a prefix, a suffix or both, optionally a closing mark."""
    kind = rng.random()
    if kind < 0.3 and len(core) >= SHORT_CORE:  # the shortest frame, closest to a bare command
        prefix, suffix = ("please ", "") if kind < 0.15 else ("", " please")
    else:
        prefix = rng.choice(PREFIXES) if kind < 0.8 else ""
        suffix = rng.choice(SUFFIXES) if kind >= 0.6 else ""
    text = prefix + core + suffix + rng.choice(("", "", ".", "!", "?" if prefix.strip().endswith("you") else "."))
    return text[0].upper() + text[1:] if rng.random() < 0.5 else text


def _call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": {key: value for key, value in arguments.items() if value is not None}}


def _fan_switch_form(kind: str, rng: random.Random) -> str:
    """A fan on/off request with its verb chosen and ``{room}`` still to fill."""
    if rng.random() < 0.3:
        return rng.choice(FAN_SPLIT_TEMPLATES).replace("{kind}", kind)
    return rng.choice(FAN_FORMS).replace("{verb}", rng.choice(FAN_VERBS[kind]))


def _blinds_form(action: str, rng: random.Random) -> str:
    """A blinds request for ``action`` with its verb chosen and ``{room}`` still to fill."""
    kind = rng.random()
    if kind < 0.55:
        return rng.choice(BLIND_FORMS).replace("{verb}", rng.choice(BLIND_VERBS[action]))
    return rng.choice((BLIND_PLAIN_TEMPLATES if kind < 0.85 else BLIND_SHORT_TEMPLATES)[action])


def _positive_core(rng: random.Random, *, tool_name: Optional[str] = None) -> tuple[str, dict]:
    """(a query core without its frame, its call) for one supported action."""
    name = tool_name or rng.choice([tool["name"] for tool in SMART_HOME_TOOLS])
    if name == "control_lights":
        room = rng.choice(ROOMS)
        kind = rng.choice(("on", "off", "on", "off", "dim", "dim", "color"))
        if kind in ("on", "off"):
            if rng.random() < 0.35:
                v1, v2 = rng.choice(SPLIT_VERBS[kind])
                core = rng.choice(LIGHT_SPLIT_TEMPLATES).format(v1=v1, v2=v2, room=_room_text(room, rng))
            else:
                verbs = LIGHT_ON_VERBS if kind == "on" else LIGHT_OFF_VERBS
                core = rng.choice(LIGHT_TEMPLATES).format(verb=rng.choice(verbs), room=_room_text(room, rng))
            return core, _call(name, room=room, action=kind)
        if kind == "dim":
            n = rng.randint(0, 100)
            return rng.choice(DIM_TEMPLATES).format(room=_room_text(room, rng), n=n), _call(
                name, room=room, action="dim", brightness_percent=n)
        color = rng.choice(COLORS)
        if rng.random() < 0.5:  # any switch-on form with the colour after it
            if rng.random() < 0.5:
                v1, v2 = rng.choice(SPLIT_VERBS["on"])
                core = rng.choice(LIGHT_SPLIT_TEMPLATES).format(v1=v1, v2=v2, room=_room_text(room, rng))
            else:
                core = rng.choice(LIGHT_TEMPLATES).format(verb=rng.choice(LIGHT_ON_VERBS), room=_room_text(room, rng))
            core += rng.choice(COLOR_TAILS).format(color=color)
        else:
            core = rng.choice(COLOR_TEMPLATES).format(room=_room_text(room, rng), color=color)
        return core, _call(name, room=room, action="on", color=color)
    if name == "set_thermostat":
        n = rng.randint(10, 30)
        return rng.choice(THERMOSTAT_TEMPLATES).format(n=n), _call(name, temperature=n)
    if name == "control_fan":
        room = rng.choice(FAN_ROOMS)
        kind = rng.choice(("on", "off", "speed"))
        if kind == "speed":
            speed = rng.choice(SPEEDS)
            return rng.choice(FAN_SPEED_TEMPLATES).format(room=_room_text(room, rng), speed=speed), _call(
                name, room=room, action="on", speed=speed)
        return _fan_switch_form(kind, rng).format(room=_room_text(room, rng)), _call(name, room=room, action=kind)
    if name == "control_blinds":
        room, action = rng.choice(ROOMS), rng.choice(("open", "close"))
        return _blinds_form(action, rng).format(room=_room_text(room, rng)), _call(name, room=room, action=action)
    kind = rng.choice(("start", "start_room", "start_room", "stop", "stop", "dock"))
    if kind == "start_room":
        room = rng.choice(VACUUM_ROOMS)
        return rng.choice(VACUUM_ROOM_TEMPLATES).format(room=_room_text(room, rng)), _call(
            name, action="start", room=room)
    if rng.random() < 0.6:
        return rng.choice(VACUUM_FORMS).format(verb=rng.choice(VACUUM_VERBS[kind])), _call(name, action=kind)
    templates = {"start": VACUUM_START_TEMPLATES, "stop": VACUUM_STOP_TEMPLATES, "dock": VACUUM_DOCK_TEMPLATES}[kind]
    return rng.choice(templates), _call(name, action=kind)


def _roomless(template: str) -> str:
    """``template`` with its room taken out ("the {room} fan" -> "the fan", "lights in the {room}" -> "lights")."""
    for with_room, without in ((" in the {room}", ""), (" of the {room}", ""), (" into the {room}", " in"),
                               ("the {room} ", "the "), ("{room} ", "")):
        template = template.replace(with_room, without)
    return template


def _missing_room_core(rng: random.Random) -> str:
    """A supported action in any of the positives' verbs and word orders, with the room left out."""
    device = rng.choice(("lights", "lights", "fan", "blinds", "blinds"))
    if device == "lights":
        kind = rng.random()
        if kind < 0.3:
            v1, v2 = rng.choice(SPLIT_VERBS[rng.choice(("on", "off"))])
            return _roomless(rng.choice(LIGHT_SPLIT_TEMPLATES)).format(v1=v1, v2=v2)
        if kind < 0.6:
            verbs = rng.choice((LIGHT_ON_VERBS, LIGHT_OFF_VERBS))
            return _roomless(rng.choice(LIGHT_TEMPLATES)).format(verb=rng.choice(verbs))
        if kind < 0.8:
            return _roomless(rng.choice(DIM_TEMPLATES)).format(n=rng.randint(0, 100))
        return _roomless(rng.choice(COLOR_TEMPLATES)).format(color=rng.choice(COLORS))
    if device == "fan":
        kind = rng.choice(("on", "off", "speed"))
        if kind == "speed":
            return _roomless(rng.choice(FAN_SPEED_TEMPLATES)).format(speed=rng.choice(SPEEDS))
        return _roomless(_fan_switch_form(kind, rng))
    return _roomless(_blinds_form(rng.choice(("open", "close")), rng))


def _slots(rng: random.Random) -> dict:
    return {"room": _room_text(rng.choice(ROOMS), rng), "fan_room": _room_text(rng.choice(FAN_ROOMS), rng),
            "n": rng.randint(10, 30), "p": rng.randint(0, 100), "color": rng.choice(COLORS),
            "bad_p": rng.randint(101, 300), "bad_t": rng.choice([*range(0, 10), *range(31, 61)]),
            "other_room": rng.choice(OTHER_ROOMS), "other_color": rng.choice(OTHER_COLORS)}


def make_example(category: str, rng: random.Random) -> dict:
    """One example of ``category`` (query, answers) without tools or system (see `make_smart_home_examples`)."""
    if category == "positive":
        core, call = _positive_core(rng)
        return {"query": _frame(core, rng), "answers": [call], "category": category}
    if category == "parallel":
        names = [tool["name"] for tool in SMART_HOME_TOOLS]
        first, second = rng.sample(names, 2)
        (core1, call1), (core2, call2) = _positive_core(rng, tool_name=first), _positive_core(rng, tool_name=second)
        return {"query": _frame(core1 + rng.choice(PARALLEL_JOINERS) + core2, rng), "answers": [call1, call2],
                "category": category}
    slots = _slots(rng)
    if category == "missing":
        core = _missing_room_core(rng) if rng.random() < 0.6 else rng.choice(MISSING_TEMPLATES).format(**slots)
    elif category == "irrelevant":
        kind = rng.random()
        if kind < 0.3:
            core = rng.choice(STATE_QUESTION_FRAMES).format(state=rng.choice(STATES).format(**slots))
        elif kind < 0.55:
            core = rng.choice(OTHER_APP_ROOM_FORMS).format(request=rng.choice(OTHER_APP_REQUESTS), **slots)
        else:
            core = rng.choice(IRRELEVANT_TEMPLATES).format(**slots)
    elif category == "negation":
        action = rng.choice(NEGATION_ACTIONS).format(**slots)
        core = rng.choice(NEGATION_TEMPLATES).format(action=action)
    elif category == "invalid":
        core = rng.choice(INVALID_TEMPLATES)[0].format(**slots)
    else:
        raise ValueError(f"category: expected one of {', '.join(CATEGORIES)}, got {category!r}")
    return {"query": _frame(core, rng), "answers": [], "category": category}


def make_smart_home_examples(count: int, *, seed: int, split: Optional[str] = None, tools: Optional[list] = None,
                             systems: Optional[list] = None) -> list[dict]:
    """``count`` examples in the fine-tuning JSONL format plus a ``category`` key (drop it before writing).

    Args:
        count: how many examples; categories follow `CATEGORY_WEIGHTS` (drawn per example).
        seed: the random seed (same seed, same examples).
        split: None (every query), "train" (never a held-out query) or "held_out" (only those).
        tools: the tool schemas every example offers (default `SMART_HOME_TOOLS`).
        systems: system texts, one drawn per example (default `SYSTEM_TEXTS`).
    """
    if split not in (None, "train", "held_out"):
        raise ValueError(f"split: expected None, 'train' or 'held_out', got {split!r}")
    rng = random.Random(seed)
    tools = list(SMART_HOME_TOOLS if tools is None else tools)
    systems = list(SYSTEM_TEXTS if systems is None else systems)
    categories, weights = list(CATEGORY_WEIGHTS), list(CATEGORY_WEIGHTS.values())
    examples = []
    while len(examples) < count:
        example = make_example(rng.choices(categories, weights)[0], rng)
        if split is not None and is_held_out_query(example["query"]) != (split == "held_out"):
            continue
        examples.append({**example, "tools": tools, "system": rng.choice(systems)})
    return examples


__all__ = ["CATEGORIES", "HELD_OUT_SEED", "SMART_HOME_FUNCTIONS", "SMART_HOME_TOOLS", "SYSTEM_TEXTS", "TRAIN_SEED",
           "is_held_out_query", "make_example", "make_smart_home_examples"]
