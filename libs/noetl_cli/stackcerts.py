"""The local stack's TLS: a certificate authority made at ``dev up`` and one certificate
it signs for every role (``localhost``, 127.0.0.1, ::1), under ``<home>/dev/tls/``
(keys mode 0600). Every role serves gRPC over TLS with it and trusts the CA; the CLI and
the tests trust the CA. Made with ``cryptography`` (ECDSA P-256, valid 30 days: a local
stack lives for a session)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DIR = "tls"
CA = "ca.crt"
CERT = "server.crt"
KEY = "server.key"
VALID_DAYS = 30


def paths(dev: Path) -> dict[str, Path]:
    base = dev / DIR
    return {"ca": base / CA, "cert": base / CERT, "key": base / KEY}


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def ensure(dev: Path) -> dict[str, Path]:
    """Make the CA and the roles' certificate unless they exist; returns their paths."""
    files = paths(dev)
    if all(p.exists() for p in files.values()):
        return files
    files["ca"].parent.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "noetl local stack CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
             x509.IPAddress(ipaddress.ip_address("::1"))]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(until)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(files["ca"], ca.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(files["cert"], cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(files["key"], key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), 0o600)
    return files
