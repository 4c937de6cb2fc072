"""A small acceptance suite in the reference's format, for the demo model's phone tools.

TOOLS are the demo's schema dicts (the model was trained on exactly these), SYSTEM is empty, and
the cases are written here: requests the demo answers (passes), a negated request and an
unsupported one (answered with a call that validation voids: the expected answer is no call), and
two requests in one query (the demo makes one call: a failure). Tests load it by dotted name and
by file path, like a user's module.
"""

from needle_hf.demo.data import DEMO_DATA_TOOLS

TOOLS = DEMO_DATA_TOOLS[:3]  # set_alarm, send_message, play_music
SYSTEM = ""


def _call(name, **arguments):
    return {"name": name, "arguments": arguments}


TEST_CASES = [
    {"query": "Set an alarm for 6:45.", "calls": [_call("set_alarm", time="6:45")], "category": "positive",
     "critical": False},
    {"query": "Wake me at 5:15 please.", "calls": [_call("set_alarm", time="5:15")], "category": "positive",
     "critical": False},
    {"query": "Play Imagine.", "calls": [_call("play_music", song="Imagine")], "category": "positive",
     "critical": False},
    {"query": "Text Bob that see you soon.", "calls": [_call("send_message", to="Bob", text="see you soon")],
     "category": "positive", "critical": False},
    {"query": "Don't set an alarm for 7:00.", "calls": [], "category": "negation", "critical": True},
    {"query": "do not play Yellow", "calls": [], "category": "negation", "critical": True},
    {"query": "Set an alarm.", "calls": [], "category": "missing", "critical": False},
    {"query": "What is the capital of France?", "calls": [], "category": "irrelevant", "critical": True},
    {"query": "Play Hey Jude and set an alarm for 8:00.",
     "calls": [_call("play_music", song="Hey Jude"), _call("set_alarm", time="8:00")], "category": "parallel",
     "critical": False},
    {"query": "Put on Clocks.", "calls": [_call("play_music", song="Clocks")], "category": "positive"},
]
