"""A throw-away certificate authority for the provider simulators.

The simulators serve TLS with leaf certificates issued by `SimulatorCA`; clients
under test trust `SimulatorCA.ca_path` (a PEM file) instead of the system store.
"""

from __future__ import annotations

import datetime
import ssl
import tempfile
from collections.abc import Iterable
from pathlib import Path

import trustme

#: Names the APNs simulator certificate carries. aioapns uses its `APNS_SERVER`
#: class attribute as the SNI name, the checked hostname and the `host` header,
#: so the certificate must name Apple's hosts even though the socket goes to
#: 127.0.0.1 (specs/providers.md §4.1).
APNS_HOSTNAMES: tuple[str, ...] = (
    "api.push.apple.com",
    "api.sandbox.push.apple.com",
    "api.development.push.apple.com",
    "localhost",
    "127.0.0.1",
    "::1",
)

#: Names the (optional) TLS FCM simulator certificate carries.
FCM_HOSTNAMES: tuple[str, ...] = (
    "fcm.googleapis.com",
    "oauth2.googleapis.com",
    "localhost",
    "127.0.0.1",
    "::1",
)


class SimulatorCA:
    """A private CA (built on `trustme`) that writes its PEM files into a directory.

    `directory` defaults to a fresh temporary directory, removed by `cleanup()`.
    `ca_path` is the CA certificate (PEM) that clients must trust.
    """

    def __init__(self, directory: str | Path | None = None) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pushgw-sim-ca-")
            directory = self._tmp.name
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._ca = trustme.CA(organization_name="pushgw simulator CA")
        self.ca_path = self.directory / "simulator-ca.pem"
        self._ca.cert_pem.write_to_path(str(self.ca_path))
        self._issued = 0

    @property
    def ca_pem(self) -> bytes:
        """The CA certificate as PEM bytes."""
        return self._ca.cert_pem.bytes()

    def issue(self, hostnames: Iterable[str]) -> tuple[Path, Path]:
        """Issue a leaf certificate for `hostnames` (DNS names or IP addresses).

        Returns `(cert_pem_path, key_pem_path)`; the certificate file holds the chain.
        """
        names = list(hostnames)
        if not names:
            raise ValueError("at least one hostname is required")
        leaf = self._ca.issue_cert(*names)
        self._issued += 1
        cert_path = self.directory / f"leaf-{self._issued}.crt.pem"
        key_path = self.directory / f"leaf-{self._issued}.key.pem"
        with cert_path.open("wb") as f:
            for blob in leaf.cert_chain_pems:
                f.write(blob.bytes())
        leaf.private_key_pem.write_to_path(str(key_path))
        key_path.chmod(0o600)
        return cert_path, key_path

    def issue_client_certificate(
        self,
        topic: str,
        *,
        not_before: datetime.datetime | None = None,
        not_after: datetime.datetime | None = None,
    ) -> Path:
        """Issue an APNs-style push certificate for `topic` (common name
        `Apple Push Services: <topic>`), valid from `not_before` to `not_after` (default:
        from now to a year on; a past `not_after` makes an expired one).

        Returns one PEM file holding the certificate and then its unencrypted key, the
        form an app's `certfile` takes. `ApnsSimulator(client_certificates=True)` with
        this CA accepts it while it is valid.
        """
        leaf = self._ca.issue_cert(
            common_name=f"Apple Push Services: {topic}",
            not_before=not_before,
            not_after=not_after,
        )
        self._issued += 1
        path = self.directory / f"client-{self._issued}.pem"
        path.write_bytes(leaf.cert_chain_pems[0].bytes() + leaf.private_key_pem.bytes())
        path.chmod(0o600)
        return path

    def server_context(
        self, hostnames: Iterable[str], alpn: Iterable[str] | None = None
    ) -> ssl.SSLContext:
        """A TLS 1.2+ server context with a fresh leaf certificate for `hostnames`."""
        cert_path, key_path = self.issue(hostnames)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(cert_path), str(key_path))
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts only this CA (hostname checking on)."""
        return ssl.create_default_context(cafile=str(self.ca_path))

    def cleanup(self) -> None:
        """Remove the temporary directory, if this CA created one."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
