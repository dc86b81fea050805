"""The `--ssl-keyfile`/`--ssl-certfile` pair (vLLM's flags), shared by the
frontend (HTTPS, client gRPC) and the scheduler (its gRPC control service):
checked up front, as grpc server credentials, and as what a client of that
server trusts (the frontend's control client, given the same files).

A client trusts the certificate itself when it is self-signed (the usual case
for a private service), else the certificate authorities grpc trusts by default
(`GRPC_DEFAULT_SSL_ROOTS_FILE_PATH` names another CA file). It checks the name
in the certificate rather than the one it dials: the control service is often
reached by a Unix socket or an internal name the certificate was not issued for.
"""
from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass

import grpc

from common.errors import ConfigError


def _check_key_pair(keyfile: str, certfile: str) -> None:
    """Load the pair as a server would. Checked up front: grpc reports a file that
    is not PEM, or a key of another certificate, only as a failed bind (which read
    as "port in use"), and the component would then exit and be restarted forever."""
    try:  # the password callback stops OpenSSL from prompting on the tty for an encrypted key
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        why = ("the key is not that of the certificate" if "MISMATCH" in reason
               else "a file is not PEM, or the key is encrypted" if "PEM" in reason else reason)
        raise ConfigError(f"cannot use --ssl-keyfile {keyfile} with --ssl-certfile {certfile}: {why} "
                          f"(both must be PEM files, the key unencrypted)") from None


def _certificate_name_and_issuer(certfile: str) -> tuple[str | None, bool]:
    """(a name the certificate is valid for, whether it is self-signed). The ssl
    module has no public PEM parser; the private one has been in CPython for a decade."""
    try:
        info = ssl._ssl._test_decode_cert(certfile)  # type: ignore[attr-defined]
    except (AttributeError, ssl.SSLError, OSError, ValueError):
        return None, False
    alt_names = info.get("subjectAltName", ())
    names = ([value for kind, value in alt_names if kind == "DNS"]
             + [value for kind, value in alt_names if kind == "IP Address"]
             + [value for rdn in info.get("subject", ()) for key, value in rdn if key == "commonName"])
    name = names[0] if names else None
    if name and name.startswith("*."):  # a wildcard certificate: any name it covers
        name = "pagedserve-control" + name[1:]
    return name, info.get("subject") == info.get("issuer")


@dataclass(frozen=True, slots=True)
class TlsFiles:
    keyfile: str
    certfile: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TlsFiles | None":
        """The key and certificate, checked readable (a ConfigError naming the flag), or None."""
        if not args.ssl_keyfile and not args.ssl_certfile:
            return None
        if not (args.ssl_keyfile and args.ssl_certfile):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
        for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
            if not os.access(path, os.R_OK) or not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such readable file")
        _check_key_pair(args.ssl_keyfile, args.ssl_certfile)
        return cls(args.ssl_keyfile, args.ssl_certfile)

    def grpc_key_pair(self) -> tuple[bytes, bytes]:
        with open(self.keyfile, "rb") as key, open(self.certfile, "rb") as cert:
            return key.read(), cert.read()

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([self.grpc_key_pair()])

    def client_credentials(self) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
        """(channel credentials, channel options) for a client of a server that
        serves this certificate (see the module's docstring)."""
        name, self_signed = _certificate_name_and_issuer(self.certfile)
        with open(self.certfile, "rb") as cert:
            roots = cert.read() if self_signed else None
        options = [("grpc.ssl_target_name_override", name)] if name else []
        return grpc.ssl_channel_credentials(root_certificates=roots), options
