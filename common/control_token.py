"""The bearer token of the scheduler's gRPC control service.

Every control call but Health needs the metadata `authorization: Bearer <token>`
once the deployment has a secret: the API key (`PAGEDSERVE_API_KEY`), or the
ZeroMQ CURVE cluster secret, from which a token is derived (HMAC-SHA256 of a
fixed label: the secret itself never goes on the wire). The scheduler accepts
either one it knows; a client sends the CURVE-derived token when it has the
cluster secret (every component of a CURVE deployment has it, while the API
key is often given to the frontend alone), else the API key. With neither,
the service stays open, as on a single host (loopback or a private Unix socket).
"""
from __future__ import annotations

import hashlib
import hmac

from common.transport import CurveKeys, curve_keys_from_env

CONTROL_TOKEN_LABEL = b"pagedserve-control"


def curve_control_token(keys: CurveKeys) -> str:
    """The token derived from the cluster secret (hex)."""
    return hmac.new(keys.secret, CONTROL_TOKEN_LABEL, hashlib.sha256).hexdigest()


def accepted_tokens(api_key: str | None, curve: CurveKeys | None = None) -> list[str]:
    """What the control service accepts (empty: it is open). `curve` defaults to the environment's."""
    keys = curve or curve_keys_from_env()
    return [token for token in (api_key or None, curve_control_token(keys) if keys else None) if token]


def client_token(api_key: str | None, curve: CurveKeys | None = None) -> str | None:
    """What a client sends: the CURVE-derived token when it has the cluster secret, else the API key."""
    keys = curve or curve_keys_from_env()
    return curve_control_token(keys) if keys else (api_key or None)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def bearer_matches(authorization: str | None, tokens: list[str]) -> bool:
    """Whether the `authorization` value ("Bearer <token>") carries one of `tokens`.
    Every token is compared, in constant time: the time taken says nothing of the token."""
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip().encode()
    matches = [hmac.compare_digest(given, expected.encode()) for expected in tokens]
    return scheme.lower() == "bearer" and any(matches)
