"""TLS and mutual TLS between the gateway and the stages, with certificates made at test time.

A throwaway CA signs a stage certificate (SAN ``127.0.0.1``/``localhost``) and a gateway client
certificate; a second, unrelated CA signs an impostor client certificate. Real ``StageServer``s (the
front every stage uses) serve on loopback; the clients are the gateway's own :class:`StageClient` and
the gateway app itself (its ``/health`` through the stage health monitor).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gateway_server import ThreadedGateway

from gateway.config import GatewayConfig
from gateway.stage_clients import STAGE_SERVICES, StageClient
from services.common.deploy_profile import load_profile
from services.common.grpc_server import ServeOptions, StageServer
from services.common.tls import ClientTLS, ServerTLS, server_tls_args

REPO = Path(__file__).resolve().parents[1]
x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[str, str]:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


def _cert(
    subject: str,
    issuer: tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_key, issuer_name = (issuer[0], issuer[1].subject) if issuer else (key, _name(subject))
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return key, builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("certs")
    ca = _cert("minicpmo test CA", None, ca=True)
    rogue = _cert("someone else's CA", None, ca=True)
    out: dict[str, str] = {}
    out["ca"], _ = _write(d / "ca", *ca)
    out["rogue_ca"], _ = _write(d / "rogue-ca", *rogue)
    out["stage_cert"], out["stage_key"] = _write(d / "stage", *_cert("stage", ca, server=True))
    out["gw_cert"], out["gw_key"] = _write(d / "gateway", *_cert("gateway", ca))
    out["rogue_cert"], out["rogue_key"] = _write(d / "impostor", *_cert("impostor", rogue))
    return out


def _server(stage: str, tls: ServerTLS | None) -> StageServer:
    """The real stage front with no stage servicer: health (what the gateway probes) is all we need."""
    return StageServer(
        stage,
        STAGE_SERVICES[stage],
        lambda _server: None,
        ServeOptions(host="127.0.0.1", port=0, metrics_port=0, tls=tls),
    )


async def _serving(port: int, tls: ClientTLS | None) -> tuple[bool, str]:
    client = StageClient("code2wav", f"127.0.0.1:{port}", tls=tls)
    try:
        return await client.check_health(timeout_s=3.0)
    finally:
        await client.close()


def test_tls_verifies_the_stage(certs: dict[str, str]) -> None:
    async def run() -> None:
        server = _server("code2wav", ServerTLS(certs["stage_cert"], certs["stage_key"]))
        port = await server.start()
        try:
            assert (await _serving(port, ClientTLS(certs["ca"]))) == (True, "serving")
            ok, reason = await _serving(port, None)  # plaintext client against a TLS port
            assert not ok and reason.startswith("UNAVAILABLE")
            ok, _ = await _serving(port, ClientTLS(certs["rogue_ca"]))  # stage cert not from a CA it trusts
            assert not ok
        finally:
            await server.stop(grace=0)

    asyncio.run(run())


def test_mutual_tls_refuses_clients_without_a_good_certificate(certs: dict[str, str]) -> None:
    async def run() -> None:
        server = _server("code2wav", ServerTLS(certs["stage_cert"], certs["stage_key"], certs["ca"]))
        port = await server.start()
        try:
            good = ClientTLS(certs["ca"], certs["gw_cert"], certs["gw_key"])
            assert (await _serving(port, good)) == (True, "serving")
            for who, tls in (
                ("no client certificate", ClientTLS(certs["ca"])),
                (
                    "a certificate from another CA",
                    ClientTLS(certs["ca"], certs["rogue_cert"], certs["rogue_key"]),
                ),
                ("plaintext", None),
            ):
                ok, reason = await _serving(port, tls)
                assert not ok, f"a client with {who} was let in"
                assert reason.startswith("UNAVAILABLE"), (who, reason)
            # the container health probe (docker/grpc_health_probe.py) speaks mTLS from its environment
            probe_env = {
                "MINICPMO_TLS_CERT": certs["stage_cert"],
                "MINICPMO_TLS_KEY": certs["stage_key"],
                "MINICPMO_TLS_CA": certs["ca"],
                "MINICPMO_TLS_PROBE_CERT": certs["gw_cert"],
                "MINICPMO_TLS_PROBE_KEY": certs["gw_key"],
            }
            probe = [sys.executable, str(REPO / "docker" / "grpc_health_probe.py"), "--port", str(port)]
            done = await asyncio.to_thread(
                subprocess.run,
                probe,
                env={**os.environ, **probe_env},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0 and "SERVING" in done.stdout, done.stdout + done.stderr
            plain = {k: v for k, v in os.environ.items() if not k.startswith("MINICPMO_TLS")}
            done = await asyncio.to_thread(
                subprocess.run, probe, env=plain, capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 1, done.stdout
        finally:
            await server.stop(grace=0)

    asyncio.run(run())


def test_gateway_reaches_mtls_stages_through_the_profile(certs: dict[str, str]) -> None:
    """The deploy profile's tls section is all the gateway needs; without it the same stages refuse it."""
    tls = {
        "ca_file": certs["ca"],
        "cert_file": certs["stage_cert"],
        "key_file": certs["stage_key"],
        "client_cert_file": certs["gw_cert"],
        "client_key_file": certs["gw_key"],
        "require_client_cert": True,
    }
    profile = load_profile("cpu").with_overrides({"tls": tls})
    assert profile.tls is not None and profile.tls.require_client_cert

    async def run() -> None:
        server_tls = ServerTLS(profile.tls.cert_file, profile.tls.key_file, profile.tls.ca_file)
        servers = {stage: _server(stage, server_tls) for stage in STAGE_SERVICES}
        addrs = {stage: f"127.0.0.1:{await s.start()}" for stage, s in servers.items()}
        try:
            for config, want in (
                (GatewayConfig(stage_addrs=addrs, profile=profile), 200),
                (GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu")), 503),
            ):
                with ThreadedGateway(config) as gw:
                    r = await asyncio.to_thread(httpx.get, f"{gw.url}/health", timeout=10)
                    assert r.status_code == want, r.text
        finally:
            for s in servers.values():
                await s.stop(grace=0)

    asyncio.run(run())


def test_tls_flags_and_profile_are_checked() -> None:
    assert server_tls_args(None, None, None) is None
    with pytest.raises(ValueError):
        server_tls_args("cert.pem", None, None)
    with pytest.raises(ValueError):
        server_tls_args(None, None, "ca.pem")
    with pytest.raises(ValueError):
        ClientTLS("ca.pem", "cert.pem", None)
    from services.common.deploy_profile import ProfileError

    with pytest.raises(ProfileError, match="require_client_cert"):
        load_profile("cpu").with_overrides(
            {"tls": {"ca_file": "a", "cert_file": "b", "key_file": "c", "require_client_cert": True}}
        )
    with pytest.raises(ProfileError, match="required"):
        load_profile("cpu").with_overrides({"tls": {"ca_file": "a"}})
