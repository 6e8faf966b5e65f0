"""The fault suite's shared reference: one uninterrupted run every faulted run is held to."""

import pytest

from gradlab.cli.main import main

from .helpers import RUN, STEPS


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`STEPS` rollout steps of the tiny run, uninterrupted (in this process, one thread)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["tandem", "--out", str(out), *RUN, "--steps", str(STEPS)]) == 0
    return out
