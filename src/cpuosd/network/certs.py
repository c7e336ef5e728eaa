"""A sandbox's egress CA and the leaf certificates the egress proxy presents for the hosts of
its secrets (EC P-256, made with ``cryptography``). Imported where a certificate is made, not
at the daemon's start (``cryptography.x509`` is ~40 ms of imports)."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca() -> tuple[str, str]:
    """(private key, certificate) of a new CA, PEM; valid 30 days."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cpuos sandbox egress CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                         False, False), critical=True)
            .sign(key, hashes.SHA256()))
    return _key_pem(key).decode(), cert.public_bytes(serialization.Encoding.PEM).decode()


def leaf(ca_key_pem: str, ca_cert_pem: str, host: str) -> tuple[bytes, bytes]:
    """(private key, certificate) for ``host``, PEM, signed by the CA; valid 7 days."""
    ca_key = serialization.load_pem_private_key(ca_key_pem.encode(), None)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem.encode())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)
