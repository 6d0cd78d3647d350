"""The bus lets no one in: a real nats-server with users and TLS, as `shoal dev-cluster` and the
Helm chart configure it, refuses a client without credentials, allows each role only what it
needs, and serves a gateway and a worker that present theirs; payloads in the Object Store
expire; bad settings are a ConfigError that says what is wrong.

The module's nats-server takes a user and password (the gateway's) and an nkey (the workers', as
dev-cluster makes them), over TLS with client certificates, all made here by `cryptography`.
Gateway and worker run in this process with stand-in services (tests/test_cluster_light.py's
`cluster`), torch-free.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import nats
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from shoal.calls import EncodeCall
from shoal.catalog import Catalog
from shoal.cluster import nats_auth
from shoal.cluster import protocol as p
from shoal.cluster.cli import free_port, start_nats, wait_for_port
from shoal.cluster.gateway import RemoteService
from shoal.cluster.nats_auth import GATEWAY, WORKER, DevCredentials, server_config
from shoal.cluster.worker import Worker
from shoal.config import ClusterSettings, EngineSettings, Settings
from shoal.errors import ConfigError
from shoal.metrics import Metrics
from standin import StandIn

MODEL = "standin/dense-16"
PASSWORD = "gateway-secret-" + os.urandom(8).hex()

pytestmark = pytest.mark.timeout(120)


# --- a CA, a server certificate for 127.0.0.1, a client certificate -------------------------------


def _certificates(directory: Path) -> dict[str, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def issue(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, usage=None, ip: str | None = None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            ).add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        else:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
            )
        if ip:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False
            )
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem: str, cert, key) -> None:
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{stem}-key.pem").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    write("ca", issue("shoal test CA", ca_key, "shoal test CA", ca_key, ca=True), ca_key)
    write(
        "server",
        issue("nats", server_key, "shoal test CA", ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH, ip="127.0.0.1"),
        server_key,
    )
    write(
        "client", issue("shoal", client_key, "shoal test CA", ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH), client_key
    )
    return {stem: directory / f"{stem}.pem" for stem in ("ca", "server", "client")} | {
        f"{stem}-key": directory / f"{stem}-key.pem" for stem in ("server", "client")
    }


class Bus:
    """The module's nats-server (users, permissions, TLS with client certificates) and the
    settings of each role."""

    def __init__(self, root: Path) -> None:
        self.files = _certificates(root)
        self.credentials = DevCredentials.make(root)
        users = [
            {"user": "shoal-gateway", "password": PASSWORD, "permissions": nats_auth.PERMISSIONS[GATEWAY]},
            *[user for user in self.credentials.users() if user["permissions"] is nats_auth.PERMISSIONS[WORKER]],
        ]
        tls = {
            "cert_file": str(self.files["server"]),
            "key_file": str(self.files["server-key"]),
            "ca_file": str(self.files["ca"]),
            "verify": True,  # client certificates too
        }
        config = root / "nats.conf"
        config.write_text(server_config(users, tls=tls))
        self.port = free_port()
        self.process = start_nats(self.port, root / "jetstream", config=config)
        self.url = f"tls://127.0.0.1:{self.port}"
        tls_settings = ClusterSettings(
            nats_url=self.url,
            nats_tls_ca_file=self.files["ca"],
            nats_tls_cert_file=self.files["client"],
            nats_tls_key_file=self.files["client-key"],
        )
        self.gateway = replace(tls_settings, nats_user="shoal-gateway", nats_password=PASSWORD)
        self.worker = replace(tls_settings, nats_nkey_seed_file=self.credentials.seed_files[WORKER])
        self.anonymous = tls_settings

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module")
def bus(tmp_path_factory):
    started = Bus(tmp_path_factory.mktemp("bus"))
    yield started
    started.stop()


def run(coro):
    return asyncio.run(coro)


async def _connect(settings: ClusterSettings, errors: list | None = None):
    """A plain nats-py client with `settings`' credentials and TLS, no reconnects."""

    async def collect(exc: Exception) -> None:
        if errors is not None:
            errors.append(exc)

    return await nats.connect(
        settings.nats_url,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        connect_timeout=5,
        error_cb=collect,
        **nats_auth.connect_options(settings),
    )


async def _refused(settings: ClusterSettings) -> str:
    """What the server says to a client of `settings`; fails if it lets it in."""
    try:
        nc = await _connect(settings)
    except Exception as exc:  # broad: nats-py raises its base Error for a refusal, ssl errors for TLS
        return str(exc)
    await nc.close()
    raise AssertionError(f"NATS let in a client with {settings!r}")


# --- who gets in --------------------------------------------------------------------------------


def test_a_client_without_credentials_or_with_wrong_ones_is_refused_at_connect(bus, tmp_path):
    async def body():
        # Over TLS with a client certificate, so the refusal is the credentials'.
        assert "Authorization Violation" in await _refused(bus.anonymous)
        assert "Authorization Violation" in await _refused(replace(bus.gateway, nats_password="guessed"))
        stranger = DevCredentials.make(tmp_path)  # a well-formed nkey the server does not know
        assert "Authorization Violation" in await _refused(
            replace(bus.worker, nats_nkey_seed_file=stranger.seed_files[WORKER])
        )

    run(body())


def test_without_the_ca_or_a_client_certificate_tls_is_refused(bus):
    async def body():
        system_cas = replace(bus.gateway, nats_tls_ca_file=None)  # tls:// and the system's CAs
        assert "CERTIFICATE_VERIFY_FAILED" in await _refused(system_cas)
        plain = replace(bus.gateway, nats_url=f"nats://127.0.0.1:{bus.port}", nats_tls_ca_file=None)
        plain = replace(plain, nats_tls_cert_file=None, nats_tls_key_file=None)
        no_client_cert = replace(bus.gateway, nats_tls_cert_file=None, nats_tls_key_file=None)
        for settings in (plain, no_client_cert):
            with pytest.raises(Exception):  # noqa: B017 (TLS required / handshake refused: nats-py's or ssl's error)
                nc = await _connect(settings)
                await nc.close()

    run(body())


def test_a_worker_may_neither_publish_calls_nor_read_a_gateways_results(bus):
    async def body():
        errors: list = []
        worker = await _connect(bus.worker, errors)
        gateway = await _connect(bus.gateway)
        try:
            js = gateway.jetstream()
            await p.ensure_queue(js, bus.gateway)
            before = (await js.stream_info(p.STREAM)).state.messages
            await worker.publish(p.work_subject("default", MODEL), b"a call")
            results = await worker.subscribe("_INBOX.shoal.gw-someone.call-1")
            wide = await worker.subscribe("_INBOX.>")  # allowed (its own JetStream replies), results filtered out
            await worker.flush()
            await gateway.publish("_INBOX.shoal.gw-someone.call-1", b"someone's result")
            await gateway.flush()
            with pytest.raises(nats.errors.TimeoutError):
                await results.next_msg(timeout=0.5)
            with pytest.raises(nats.errors.TimeoutError):
                await wide.next_msg(timeout=0.2)
            assert (await js.stream_info(p.STREAM)).state.messages == before
            said = " ".join(str(e) for e in errors)
            assert 'permissions violation for publish to "shoal.work.default.' in said
            assert 'permissions violation for subscription to "_inbox.shoal.gw-someone.call-1"' in said
            # And a gateway does not read the work queue's subjects as a worker's RPCs do.
            gateway_errors: list = []
            other = await _connect(bus.gateway, gateway_errors)
            await other.subscribe(f"{p.RPC_PREFIX}.>")
            await other.flush()
            await asyncio.sleep(0.2)
            assert "permissions violation for subscription" in " ".join(str(e) for e in gateway_errors)
            await other.close()
        finally:
            await worker.close()
            await gateway.close()

    run(body())


def test_a_gateway_and_a_worker_with_credentials_answer_an_encode_call_over_tls(bus):
    async def body():
        gateway = RemoteService(
            Settings(cluster=replace(bus.gateway, heartbeat_s=0.2), engine=EngineSettings(request_timeout_s=30.0)),
            Catalog.load(),
        )
        await gateway.start()
        stop = asyncio.Event()
        worker = Worker([StandIn()], replace(bus.worker, heartbeat_s=0.2), metrics=Metrics())
        task = asyncio.create_task(worker.run(stop))
        try:
            deadline = time.monotonic() + 20
            while not (gateway.ready and gateway.workers.live()):
                assert time.monotonic() < deadline, "the gateway never saw its worker"
                await asyncio.sleep(0.05)
            call = EncodeCall(model=MODEL, items=["a fish", "a shoal of fish"])
            got = await gateway.run(call)
            want = await StandIn().run(call)
            assert np.array_equal(np.stack(got.vectors), np.stack(want.vectors))
            tokens = (await gateway.tokenize(MODEL, ["two words"]))[0]  # an RPC through the permissions too
            assert [t.text for t in tokens] == ["[CLS]", "two", "words", "[SEP]"]
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await gateway.stop()

    run(body())


# --- payloads expire ---------------------------------------------------------------------------


def test_payloads_in_the_object_store_expire_after_payload_ttl_s_and_the_bucket_follows_the_setting(bus):
    async def body():
        nc = await _connect(bus.gateway)
        try:
            js = nc.jetstream()
            short = replace(bus.gateway, payload_ttl_s=1.0)
            await p.ensure_queue(js, bus.gateway)  # the default TTL first: an existing bucket is updated below
            await p.ensure_queue(js, short)
            assert (await js.stream_info(f"OBJ_{p.PAYLOADS}")).config.max_age == 1.0
            store = await js.object_store(p.PAYLOADS)
            await store.put("call-left-behind", b"x" * 1000)
            assert (await store.get("call-left-behind")).data == b"x" * 1000
            deadline = time.monotonic() + 10
            while "call-left-behind" in [info.name for info in await _listed(store)]:
                assert time.monotonic() < deadline, "the object outlived the bucket's TTL"
                await asyncio.sleep(0.2)
            with pytest.raises(nats.js.errors.ObjectNotFoundError):
                await store.get("call-left-behind")
            await p.ensure_queue(js, bus.gateway)  # back to the default for the other tests
            assert (await js.stream_info(f"OBJ_{p.PAYLOADS}")).config.max_age == bus.gateway.payload_ttl_s
        finally:
            await nc.close()

    run(body())


async def _listed(store) -> list:
    try:
        return await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:  # the bucket holds nothing
        return []


# --- bad settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (ClusterSettings(nats_user="shoal-gateway"), "has no password: set SHOAL_NATS_PASSWORD"),
        (ClusterSettings(nats_password="x"), "without a NATS user"),
        (ClusterSettings(nats_nkey_seed_file=Path("/nonexistent/worker.nk")), "is not a readable file"),
        (
            ClusterSettings(nats_user="u", nats_password="x", nats_creds_file=Path("a.creds")),
            "one kind of NATS credentials",
        ),
        (ClusterSettings(nats_tls_cert_file=Path("client.pem")), "needs both nats_tls_cert_file and nats_tls_key_file"),
    ],
)
def test_bad_nats_settings_are_a_config_error_that_names_the_problem(settings, says):
    with pytest.raises(ConfigError) as caught:
        nats_auth.connect_options(settings)
    assert says in caught.value.message
    # A gateway and a worker refuse them when built, not in a reconnect loop.
    with pytest.raises(ConfigError):
        RemoteService(Settings(cluster=settings), Catalog.load())
    with pytest.raises(ConfigError):
        Worker([StandIn()], settings)


def test_a_tls_file_that_is_not_a_certificate_is_a_config_error(tmp_path):
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ConfigError) as caught:
        nats_auth.connect_options(ClusterSettings(nats_tls_ca_file=junk))
    assert "NATS TLS files do not load" in caught.value.message


def test_a_payload_ttl_not_above_the_request_timeout_is_a_config_error():
    settings = Settings(cluster=ClusterSettings(payload_ttl_s=60.0), engine=EngineSettings(request_timeout_s=300.0))
    with pytest.raises(ConfigError) as caught:
        RemoteService(settings, Catalog.load())
    assert "payload_ttl_s (60) must be above request_timeout_s (300)" in caught.value.message


def test_the_password_comes_only_from_the_environment_and_never_shows_in_settings():
    settings = Settings.resolve({"SHOAL_NATS_USER": "shoal-gateway", "SHOAL_NATS_PASSWORD": PASSWORD})
    assert settings.cluster.nats_password == PASSWORD
    assert PASSWORD not in repr(settings)
    from shoal.config import declared

    (password,) = [d for d in declared() if d.name == "nats_password"]
    assert password.flags == ()


# --- dev-cluster ---------------------------------------------------------------------------------


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="dev-cluster's parts die with it through Linux's signal"
)
def test_dev_cluster_makes_credentials_its_gateway_connects_with_them_and_a_stranger_is_refused(tmp_path):
    """dev-cluster with no worker (torch-free and quick): its NATS refuses a client without
    credentials while its gateway is connected with the nkey made for it; the seeds are readable by
    their owner alone and gone once it stops."""
    port = free_port()
    log = tmp_path / "dev-cluster.log"
    env = {**os.environ, "SHOAL_PORT": str(port), "SHOAL_NATS_USER": "", "SHOAL_NATS_PASSWORD": ""}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "dev-cluster", "--workers", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 60
        while "shoal dev-cluster: http://" not in (text := log.read_text(errors="replace")):
            assert time.monotonic() < deadline and process.poll() is None, text[-3000:]
            time.sleep(0.1)
        wait_for_port(port, 10)
        nats_port = int(text.split("nats://127.0.0.1:")[1].split()[0])
        seeds = Path(text.split("nkey seeds in ")[1].split(")")[0])
        assert sorted(path.name for path in seeds.glob("*.nk")) == ["gateway.nk", "worker.nk"]
        assert {oct(path.stat().st_mode & 0o777) for path in seeds.glob("*.nk")} == {"0o600"}
        anonymous = ClusterSettings(nats_url=f"nats://127.0.0.1:{nats_port}")
        assert "Authorization Violation" in run(_refused(anonymous))
        deadline = time.monotonic() + 30
        while "shoal_gateway_nats_connected 1.0" not in httpx.get(f"http://127.0.0.1:{port}/metrics").text:
            assert time.monotonic() < deadline, "the gateway never connected with its credentials"
            time.sleep(0.2)
        assert "Authorization Violation" not in log.read_text(errors="replace")
    finally:
        process.send_signal(2)  # Ctrl-C
        process.wait(60)
    assert not seeds.exists()
