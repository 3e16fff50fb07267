"""examples/tree_transformer.py at its tiny size: packed rows train exactly like the flattened trajectories."""

import importlib
import os
import sys

import pytest

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


@pytest.mark.parametrize("argv", [["--steps", "3"], ["--steps", "2", "--dtype", "float32"],
                                  ["--steps", "2", "--cp", "2"]])
def test_example_packed_matches_flattened(argv, capfd, monkeypatch):
    # on sys.path (not loaded from a file path) so that the CP run's spawned processes import it too
    monkeypatch.syspath_prepend(EXAMPLES)
    example = importlib.import_module("tree_transformer")
    assert example.main(argv) == 0
    out = capfd.readouterr().out  # the CP run prints from its rank 0 process
    assert "within" in out and "OUTSIDE" not in out
    sys.modules.pop("tree_transformer", None)
