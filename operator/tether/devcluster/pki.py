"""Certificates and keys for the local development control plane.

Everything is generated fresh per cluster and lives in the cluster's state
directory; nothing here is meant for production.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

_VALIDITY = dt.timedelta(days=7)


PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _leaf_key() -> ec.EllipticCurvePrivateKey:
    """Leaf keys are P-256: an RSA key took 50-200 ms of CPU to generate, and the tests issue one
    for every proxy and user they make (a conformance cell: several)."""
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path

    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    def key_pem(self) -> bytes:
        return self.key.read_bytes()


class CertificateAuthority:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tether-dev-ca")])
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pair = self._write("ca", self._cert, self._key)

    @classmethod
    def load(cls, pair: CertPair, directory: Path) -> "CertificateAuthority":
        """An existing CA (a running cluster's) that issues into `directory`, leaving its own files alone.

        Tests use it to give a proxy in front of the API server a serving certificate that
        the cluster's clients (a pod's kubeconfig trusts only the cluster CA) already trust."""
        self = cls.__new__(cls)
        self.directory = directory
        self._cert = x509.load_pem_x509_certificate(pair.cert_pem())
        key = serialization.load_pem_private_key(pair.key_pem(), password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise TypeError(f"{pair.key}: expected an RSA key")
        self._key = key
        self.pair = pair
        return self

    def _write(self, stem: str, cert: x509.Certificate, key: PrivateKey) -> CertPair:
        cert_path = self.directory / f"{stem}.crt"
        key_path = self.directory / f"{stem}.key"
        cert_path.write_bytes(_pem_cert(cert))
        key_path.write_bytes(_pem_key(key))
        key_path.chmod(0o600)
        return CertPair(cert_path, key_path)

    def issue(
        self,
        stem: str,
        common_name: str,
        organizations: tuple[str, ...] = (),
        server: bool = False,
        ips: tuple[str, ...] = (),
    ) -> CertPair:
        """A leaf certificate; a server's names loopback, the in-cluster DNS names and `ips`."""
        key = _leaf_key()
        now = dt.datetime.now(dt.timezone.utc)
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [x509.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips),
                    ]
                ),
                critical=False,
            )
        return self._write(stem, builder.sign(self._key, hashes.SHA256()), key)


def write_service_account_key(path: Path) -> Path:
    """One RSA key signs service-account tokens and verifies them."""
    path.write_bytes(_pem_key(_key()))
    path.chmod(0o600)
    return path
