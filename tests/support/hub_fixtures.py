"""Pytest plugin: one local Hub per test session, with huggingface_hub pointed at it.

huggingface_hub reads `HF_ENDPOINT`, `HF_HOME`, `HF_HUB_DISABLE_XET`... once, when it is first imported, and
transformers copies some of them at its own import. So the hub is started, and the environment set, in
`pytest_configure`, before any test module is imported; every test (and every subprocess a test starts)
then talks to the local hub, with a session-private HF cache, whatever it imports. Register the plugin with
`pytest_plugins = ["hub_fixtures"]` in tests/conftest.py, and keep that conftest's module-level code from
loading huggingface_hub's settings (`huggingface_hub.constants`, transformers, anything using them): the
`local_hub` fixture detects it and fails with an explanation.

Fixtures:
    local_hub    (session) the running `LocalHub`; fails with an explanation if huggingface_hub was
                 imported before the environment could be set.
    hub_repo_id  (function) a fresh, not-yet-created repository id in the hub user's namespace.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from hub_server import LocalHub, hub_client_environment


@dataclasses.dataclass
class _SessionHub:
    hub: LocalHub
    scratch: Path
    saved_environment: dict[str, str | None]


_SESSION_HUB = pytest.StashKey[_SessionHub]()


def pytest_configure(config: pytest.Config) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="needle-hf-local-hub-"))
    hub = LocalHub(scratch / "server").start()
    environment = hub_client_environment(
        os.environ, endpoint=hub.endpoint, token=hub.token, hf_home=scratch / "hf_home"
    )
    changed = {key for key in environment.keys() | os.environ.keys() if environment.get(key) != os.environ.get(key)}
    saved = {key: os.environ.get(key) for key in changed}
    for key in changed:
        if key in environment:
            os.environ[key] = environment[key]
        else:
            del os.environ[key]
    config.stash[_SESSION_HUB] = _SessionHub(hub=hub, scratch=scratch, saved_environment=saved)


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_SESSION_HUB, None)
    if session is None:
        return
    session.hub.stop()
    for key, value in session.saved_environment.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(session.scratch, ignore_errors=True)
    del config.stash[_SESSION_HUB]


@pytest.fixture(scope="session")
def local_hub(pytestconfig: pytest.Config) -> LocalHub:
    session = pytestconfig.stash.get(_SESSION_HUB, None)
    if session is None:
        pytest.fail("the local hub is not running: add `pytest_plugins = ['hub_fixtures']` to tests/conftest.py")
    from huggingface_hub import constants

    # huggingface_hub's package import is lazy; its settings are frozen when `huggingface_hub.constants` loads.
    if constants.ENDPOINT != session.hub.endpoint:
        pytest.fail(
            f"huggingface_hub uses endpoint {constants.ENDPOINT!r}, not the local hub {session.hub.endpoint!r}: "
            "huggingface_hub.constants was loaded before hub_fixtures.pytest_configure set HF_ENDPOINT. Keep "
            "huggingface_hub, transformers and modules using them out of conftest.py's module-level code."
        )
    return session.hub


@pytest.fixture
def hub_repo_id(local_hub: LocalHub, request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-.")[:60]
    return f"{local_hub.user}/{name}-{uuid.uuid4().hex[:8]}"
