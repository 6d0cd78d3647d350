"""`import shoal` and `shoal --help` stay light: torch loads only where tensors start (the runner)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

LIGHT_MODULES = [
    "shoal",
    "shoal.wire",
    "shoal.config",
    "shoal.catalog",
    "shoal.api",
    "shoal.engine",
    "shoal.cli",
    "shoal.sdk",
    "shoal.cluster.protocol",
    "shoal.cluster.gateway",
    "shoal.cluster.worker",
    "shoal.cluster.cli",
]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_light_modules_does_not_import_torch():
    code = (
        "import json, sys\n"
        f"import {', '.join(LIGHT_MODULES)}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'safetensors'))\n"
        "print(json.dumps(heavy[:10]))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_the_check_above_would_see_torch_if_a_module_imported_it():
    # The runner is where tensors start: importing it must show up, or the test above proves nothing.
    result = run_python("import sys, shoal.engine.runner; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_shoal_help_exits_zero_without_importing_torch():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['shoal', '--help']\n"
        "try:\n"
        "    runpy.run_module('shoal.cli', run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    code = exit.code or 0\n"
        "else:\n"
        "    code = 0\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout  # the help text lists the subcommands
    assert result.stdout.strip().splitlines()[-1] == "NO-TORCH 0"


def test_the_installed_shoal_script_prints_help_and_exits_zero():
    script = shutil.which("shoal") or str(Path(sys.executable).with_name("shoal"))
    assert Path(script).is_file(), "the `shoal` console script is not installed"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: shoal" in result.stdout and "serve" in result.stdout
