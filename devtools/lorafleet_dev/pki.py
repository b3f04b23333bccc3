"""A throwaway PKI: a CA that issues server and client certificates (``cryptography``).

One implementation for everything local that speaks TLS: the control plane's serving and
client certificates (:func:`make_control_plane_pki`) and the node agent's TLS tests. Every
certificate is valid for one day (nothing local lives longer), from five minutes ago (small
clock skew).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: The names a local server certificate is valid for: loopback, and the in-cluster name of the
#: API server (clients inside a cluster address it so).
SERVER_NAMES: tuple[x509.GeneralName, ...] = (
    x509.DNSName("localhost"),
    x509.DNSName("kubernetes.default.svc"),
    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert: bytes
    key: bytes

    def write(self, cert_path: Path, key_path: Path) -> None:
        """Write both files; the key readable by its owner only (servers refuse others)."""
        cert_path.write_bytes(self.cert)
        write_private(key_path, self.key)


def write_private(path: Path, data: bytes) -> None:
    """Write key material readable by its owner only."""
    path.write_bytes(data)
    path.chmod(0o600)


def pem_private_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    """A private key as unencrypted PKCS#8 PEM."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


class Authority:
    """A self-signed CA (EC P-256) that issues server and client certificates."""

    def __init__(self, common_name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        public_key = self.key.public_key()
        self.cert = (
            self._builder(self.name, public_key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        """The CA certificate (what a client or server trusts), PEM."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        common_name: str,
        server: bool,
        *,
        organization: str | None = None,
        extra_ips: Sequence[str] = (),
        dns_names: Sequence[str] = (),
        client_too: bool = False,
    ) -> KeyPair:
        """A new key and a certificate for it: a server's (valid for :data:`SERVER_NAMES`,
        ``dns_names`` and ``extra_ips``; with ``client_too`` also for client authentication, as
        the chart's agent certificate, which the operator presents as its client certificate)
        or a client's; ``organization`` becomes the subject's O (Kubernetes reads it as a
        group)."""
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        if organization:
            attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server and client_too:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            self._builder(x509.Name(attributes), key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if server:
            names = [
                *SERVER_NAMES,
                *(x509.DNSName(name) for name in dns_names),
                *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), pem_private_key(key))

    def _builder(self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        now = dt.datetime.now(dt.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
        )


@dataclass(frozen=True)
class ControlPlanePki:
    """Paths of the PKI files one local control plane uses (all under its work dir)."""

    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    controller_manager_cert: Path
    controller_manager_key: Path
    sa_key: Path
    sa_pub: Path


def make_control_plane_pki(directory: Path, *, extra_ips: Sequence[str] = ()) -> ControlPlanePki:
    """Create a CA, the API server's serving cert (also valid for ``extra_ips``), the controller
    manager's client cert and the service-account signing key pair under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = ControlPlanePki(
        ca_cert=directory / "ca.crt",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        controller_manager_cert=directory / "controller-manager.crt",
        controller_manager_key=directory / "controller-manager.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )
    ca = Authority("lorafleet-test-ca")
    pki.ca_cert.write_bytes(ca.pem)
    ca.issue("kube-apiserver", server=True, extra_ips=extra_ips).write(pki.serving_cert, pki.serving_key)
    # The controller manager authenticates with a client cert. It is put in system:masters
    # because, without --use-service-account-credentials, its controllers all act as itself.
    ca.issue("system:kube-controller-manager", server=False, organization="system:masters").write(
        pki.controller_manager_cert, pki.controller_manager_key
    )
    # RSA for service-account tokens: accepted by every consumer of these JWTs (RS256).
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_private(pki.sa_key, pem_private_key(sa_key))
    pki.sa_pub.write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return pki
