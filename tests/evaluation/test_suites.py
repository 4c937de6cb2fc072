"""Loading suites: the reference's six from an installed cactus-needle (without its engine, its
telemetry or the network), a user's module by dotted name or file path, and a clear `SuiteError`
naming the module and the field for a module that is not in the format."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest

from needle_hf.evaluation import Suite, SuiteError, find_suites, load_suite
from needle_hf.evaluation.suites import NO_REFERENCE_SUITES, REFERENCE_TELEMETRY_OPT_OUTS

pytestmark = pytest.mark.v5  # also runs under transformers 5.x (.venv-v5)

HERE = Path(__file__).resolve().parent
REFERENCE_SUITES = ["data_capture", "kitchen_appliance", "media_player", "productivity", "smart_home", "wearable"]
CATEGORIES = {"positive", "parallel", "missing", "irrelevant", "negation", "invalid"}


def test_find_suites_loads_the_six_without_engine_telemetry_or_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("a suite loader opened a connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.delenv("NEEDLE_TELEMETRY", raising=False)
    threads = set(threading.enumerate())
    suites = find_suites()
    assert sorted(suites) == REFERENCE_SUITES
    for name, suite in suites.items():
        assert isinstance(suite, Suite) and suite.name == name and suite.source == f"needle.environments.{name}"
        assert len(suite) == 32 and len(suite.tools) == 5 and isinstance(suite.system, str) and suite.system
        assert set(suite.categories) == CATEGORIES
        assert all(set(case) == {"query", "calls", "category", "critical"} for case in suite.cases)
        assert [schema["name"] for schema in suite.schemas] == [tool._needle_tool["name"] for tool in suite.tools]
    for key, value in REFERENCE_TELEMETRY_OPT_OUTS.items():
        assert os.environ[key] == value  # set before the reference was imported
    import needle

    assert needle._lib_handles == {} and needle._active == {}  # no engine loaded
    assert set(threading.enumerate()) == threads  # no telemetry sender started
    from needle.environments import _harness

    assert not set(_harness._agents) & {suite.source for suite in suites.values()}  # no reference agent made


def test_find_suites_without_cactus_needle_is_empty_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "needle", None)  # how Python marks a package as not importable
    monkeypatch.setitem(sys.modules, "needle.environments", None)
    with pytest.warns(UserWarning, match="cactus-needle") as record:
        assert find_suites() == {}
    assert str(record[0].message) == NO_REFERENCE_SUITES


def test_a_user_module_loads_by_dotted_name_and_by_path():
    by_name = load_suite("phone_suite")
    by_path = load_suite(HERE / "phone_suite.py")
    assert by_name == by_path and by_name.name == by_path.name == "phone_suite"
    assert [case["critical"] for case in by_name.cases][-1] is False  # left out in the module: False
    assert by_name.categories == ["positive", "negation", "missing", "irrelevant", "parallel"]
    assert [schema["name"] for schema in by_name.schemas] == ["set_alarm", "send_message", "play_music"]


def _module(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


GOOD_TOOL = '{"name": "ping", "description": "Ping.", "parameters": {"type": "object", "properties": {}}}'


@pytest.mark.parametrize("source, message", [
    (f"SYSTEM = ''\nTEST_CASES = [{{'query': 'q', 'calls': [], 'category': 'c'}}]\n", "TOOLS is missing"),
    (f"TOOLS = [{GOOD_TOOL}]\nTEST_CASES = [{{'query': 'q', 'calls': [], 'category': 'c'}}]\n", "SYSTEM is missing"),
    (f"TOOLS = []\nSYSTEM = ''\nTEST_CASES = [{{'query': 'q', 'calls': [], 'category': 'c'}}]\n",
     "TOOLS: expected a non-empty list"),
    (f"TOOLS = [{GOOD_TOOL}]\nSYSTEM = ''\nTEST_CASES = [{{'query': 'q', 'calls': []}}]\n",
     "TEST_CASES[0]: missing category"),
    (f"TOOLS = [{GOOD_TOOL}]\nSYSTEM = ''\nTEST_CASES = [{{'query': 'q', 'calls': [{{'name': 'ping'}}], "
     "'category': 'c'}]\n", "TEST_CASES[0].calls[0]: expected a call"),
    (f"TOOLS = [{GOOD_TOOL}]\nSYSTEM = ''\nTEST_CASES = [{{'query': 'q', 'calls': [], 'category': 'c', "
     "'critical': 'yes'}]\n", "TEST_CASES[0].critical: expected a bool"),
    (f"TOOLS = [{GOOD_TOOL}]\nSYSTEM = 3\nTEST_CASES = [{{'query': 'q', 'calls': [], 'category': 'c'}}]\n",
     "SYSTEM: expected a str, found int"),
    ("TOOLS = [{'description': 'no name'}]\nSYSTEM = ''\nTEST_CASES = [{'query': 'q', 'calls': [], 'category': 'c'}]\n",
     "TOOLS: tools[0]: a tool schema needs a non-empty string 'name'"),
    ("raise RuntimeError('broken on purpose')\n", "importing the suite module failed: RuntimeError: broken on purpose"),
], ids=["no-tools", "no-system", "empty-tools", "no-category", "bad-call", "bad-critical", "bad-system",
        "nameless-tool", "import-fails"])
def test_a_module_out_of_format_gets_a_clear_error(tmp_path, source, message):
    path = _module(tmp_path, "my_suite", source)
    with pytest.raises(SuiteError) as error:
        load_suite(path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_unknown_names_and_paths_get_a_clear_error(tmp_path):
    with pytest.raises(SuiteError, match="no module of that name"):
        load_suite("no_such_suite_module")
    with pytest.raises(SuiteError, match="no such suite file"):
        load_suite(tmp_path / "missing.py")


def test_two_files_of_one_name_stay_apart(tmp_path):
    tool = GOOD_TOOL
    for folder, query in (("a", "first"), ("b", "second")):
        (tmp_path / folder).mkdir()
        _module(tmp_path / folder, "home", f"TOOLS = [{tool}]\nSYSTEM = ''\n"
                                          f"TEST_CASES = [{{'query': '{query}', 'calls': [], 'category': 'c'}}]\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first, second = load_suite(tmp_path / "a" / "home.py"), load_suite(tmp_path / "b" / "home.py")
    assert first.cases[0]["query"] == "first" and second.cases[0]["query"] == "second"


def test_a_suite_built_by_hand_is_checked_like_a_module():
    tool = {"name": "ping", "description": "Ping.", "parameters": {"type": "object", "properties": {}}}
    suite = Suite(name="pings", tools=(tool,), system="", cases=[{"query": "ping", "calls": [], "category": "c"}])
    assert suite.cases == [{"query": "ping", "calls": [], "category": "c", "critical": False}] and suite.tools == [tool]
    with pytest.raises(SuiteError, match=r"pings.cases\[0\].calls: expected a list of calls"):
        Suite(name="pings", tools=[tool], system="", cases=[{"query": "ping", "calls": None, "category": "c"}])
    with pytest.raises(SuiteError, match="pings.tools: expected a non-empty list"):
        Suite(name="pings", tools=[], system="", cases=[{"query": "ping", "calls": [], "category": "c"}])
