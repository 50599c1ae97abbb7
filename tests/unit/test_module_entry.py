"""`ddprun run -m MODULE ARGS`: the worker runs the module as `python -m MODULE ARGS` would."""

import json
import os
import re
import subprocess
import sys

import pytest

from ddprun.worker.bootstrap import _run_user_code

PKG = "ddprun_probe_pkg"
RECORD = """
import json, os, sys
with open(os.environ["PROBE_OUT"], "w") as fp:
    json.dump({"argv": sys.argv, "name": __name__}, fp)
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """PKG.train on sys.path; sys.argv, sys.path and the modules it imports are put back afterwards."""
    (tmp_path / PKG).mkdir()
    (tmp_path / PKG / "__init__.py").write_text("")
    (tmp_path / PKG / "train.py").write_text(RECORD)
    monkeypatch.syspath_prepend(str(tmp_path))  # also restores the cwd entry _run_user_code inserts
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "seen.json"))
    yield tmp_path
    for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
        del sys.modules[name]


def test_module_sees_the_argv_and_name_python_m_gives(package):
    _run_user_code(["-m", f"{PKG}.train", "--lr", "0.1"])
    seen = json.loads((package / "seen.json").read_text())
    assert seen == {"argv": [str(package / PKG / "train.py"), "--lr", "0.1"], "name": "__main__"}

    (package / "seen.json").unlink()
    subprocess.run([sys.executable, "-m", f"{PKG}.train", "--lr", "0.1"], cwd=package, check=True, timeout=60,
                   env={**os.environ, "PROBE_OUT": str(package / "seen.json")})
    assert json.loads((package / "seen.json").read_text()) == seen


def test_a_module_that_does_not_exist_is_an_import_error_naming_it(package):
    with pytest.raises(ImportError, match=f"^No module named {re.escape(PKG)}\\.nosuch$"):
        _run_user_code(["-m", f"{PKG}.nosuch", "--lr", "0.1"])
    assert not (package / "seen.json").exists()
