"""Self-signed certificates for TLS tests (made with the openssl command)."""
from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed_certificate(directory: Path, name: str = "localhost",
                            alt_names: str = "IP:127.0.0.1,DNS:localhost") -> tuple[Path, Path]:
    """(key.pem, cert.pem) in `directory`: a certificate for `name` and `alt_names`."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName={alt_names}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return key, cert
