"""Optional TLS / mutual TLS between the gateway and the stages (gRPC).

Off by default (plaintext gRPC, as inside one pod network or on one host). With a ``tls`` section in
the deploy profile, or the equivalent flags, every hop is encrypted and authenticated:

* each stage serves with its certificate and key (``--tls-cert``/``--tls-key``); with ``--tls-client-ca``
  it also requires a client certificate signed by that CA (mTLS) and refuses connections without one;
* the gateway (and the launcher's health probes) verify the stage certificate against ``ca_file``
  (``--stage-tls-ca``) and, for mTLS, present ``client_cert_file``/``client_key_file``
  (``--stage-tls-cert``/``--stage-tls-key``).

The stage certificate must name the address the gateway dials (SAN ``DNS:thinker``, ``IP:127.0.0.1``,
...). Files are read once at start-up; rotating them means restarting the process (a Kubernetes
rollout), which the drain on SIGTERM makes seamless.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} {path!r}: {exc.strerror}") from exc


@dataclass(frozen=True)
class ServerTLS:
    """A stage's TLS files: its certificate chain and key, and (mTLS) the CA its clients must chain to."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        key = _read(self.key_file, "key")
        cert = _read(self.cert_file, "certificate")
        client_ca = _read(self.client_ca_file, "client CA")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


@dataclass(frozen=True)
class ClientTLS:
    """What a client of the stages (gateway, probes) uses: the CA to verify them, and (mTLS) its own cert."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a TLS client certificate needs both its certificate and key file")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA"),
            private_key=_read(self.key_file, "client key"),
            certificate_chain=_read(self.cert_file, "client certificate"),
        )


def server_tls_args(cert: str | None, key: str | None, client_ca: str | None) -> ServerTLS | None:
    """The stage CLI's ``--tls-*`` flags as :class:`ServerTLS` (None: plaintext)."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together")
    return ServerTLS(cert, key, client_ca or None)
