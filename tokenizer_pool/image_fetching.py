"""http(s) image URLs, fetched by the tokenizer worker when the server allows their host
(vLLM's --allowed-media-domains; off by default). A fetch has a total deadline and a byte cap:
the body is read in chunks and dropped at the first byte past the cap. A redirect is
followed only to an allowed host. Every failure is the request's: InvalidRequestError (400).
"""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from common.errors import InvalidRequestError

DEFAULT_FETCH_TIMEOUT = 5.0  # seconds for the whole fetch (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)
_CHUNK = 64 << 10


def url_host(url: str) -> str | None:
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


def check_allowed(url: str, allowed_domains: tuple[str, ...]) -> None:
    """InvalidRequestError unless `url` is http(s) with a host in `allowed_domains` (exactly)."""
    if not allowed_domains:
        raise InvalidRequestError("image URLs over http(s) are not enabled on this server; send the image as a "
                                  "data URL (data:image/png;base64,...), or start the server with "
                                  "--allowed-media-domains HOST ...", param="messages")
    host = url_host(url)
    if urlsplit(url).scheme not in ("http", "https") or host is None or host.lower() not in allowed_domains:
        raise InvalidRequestError(f"the image URL's host {host!r} is not in --allowed-media-domains",
                                  param="messages")


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, allowed_domains: tuple[str, ...]):
        self.allowed_domains = allowed_domains

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        check_allowed(newurl, self.allowed_domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_image_bytes(url: str, allowed_domains: tuple[str, ...], max_bytes: int,
                      timeout: float = DEFAULT_FETCH_TIMEOUT) -> bytes:
    """The body at `url` (at most `max_bytes`), within `timeout` seconds in all."""
    check_allowed(url, allowed_domains)
    opener = urllib.request.build_opener(_AllowedRedirects(allowed_domains))
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "pagedserve", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise InvalidRequestError(f"the image is larger than {max_bytes} bytes", param="messages")
            body = bytearray()
            while chunk := response.read(_CHUNK):
                body += chunk
                if len(body) > max_bytes:
                    raise InvalidRequestError(f"the image is larger than {max_bytes} bytes", param="messages")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out after {timeout:g}s")
            return bytes(body)
    except InvalidRequestError:
        raise
    except urllib.error.HTTPError as exc:
        raise InvalidRequestError(f"cannot fetch the image at {url}: HTTP {exc.code}", param="messages") from None
    except (OSError, ValueError) as exc:  # refused, unreachable, timed out, malformed URL
        reason = getattr(exc, "reason", None) or exc
        raise InvalidRequestError(f"cannot fetch the image at {url}: {reason}", param="messages") from None
