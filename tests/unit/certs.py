"""Certificates for the TLS tests, made on the spot with ``cryptography``: a CA, a server
certificate it signed for ``localhost`` and ``127.0.0.1``, a client certificate it signed, and
a second CA that signed nothing of these."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    other_ca: Path  # a CA that signed none of the certificates below
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    common_name: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca[1], hashes.SHA256()), key


def make_pki(folder: Path) -> Pki:
    """The certificates and keys, as PEM files in ``folder``."""
    ca = _ca("rollserve test CA")
    other = _ca("another CA")
    server = _leaf(
        "localhost",
        ca,
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client = _leaf("trainer", ca, ExtendedKeyUsageOID.CLIENT_AUTH, [])
    pem = serialization.Encoding.PEM
    files = {
        "ca.pem": ca[0].public_bytes(pem),
        "other-ca.pem": other[0].public_bytes(pem),
        "server.pem": server[0].public_bytes(pem),
        "server-key.pem": _key_pem(server[1]),
        "client.pem": client[0].public_bytes(pem),
        "client-key.pem": _key_pem(client[1]),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return Pki(
        ca=folder / "ca.pem",
        other_ca=folder / "other-ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server-key.pem",
        client_cert=folder / "client.pem",
        client_key=folder / "client-key.pem",
    )


def encrypt_key(key_file: Path, password: bytes) -> bytes:
    """The PEM key of ``key_file``, encrypted with ``password``."""
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password),
    )
