"""The first hour of a new user (issue 22): install hints a clone can run, the commands'
own help, logs at three volumes, BLAS threads, and hostile flag values as one line."""
import os
import re
import subprocess
import sys

import pytest

from minicaffe import backend
from test_cli import REPO, SOLVER, _error_line, _messages, _setup, cli  # noqa: F401


def test_install_hints_name_what_a_clone_can_install(cli, tmp_path, monkeypatch):
    """There is no minicaffe on PyPI: the hint names the extra of the checkout."""
    monkeypatch.setattr(backend, "cp", None)
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    rc, out, err = cli("device_query")
    line = _error_line(err)
    assert rc == 1 and 'pip install ".[cuda12]"' in line, line
    assert "minicaffe[" not in line
