"""The playground page's routes on a real frontend process: `/` and its assets
are served (with a content security policy), stay open under --api-key while
/v1 is closed, and --disable-playground removes them. What the page does in a
browser: tests/browser/test_playground_browser.py."""
from __future__ import annotations

import fnmatch
import re
import tomllib

import httpx

from tests.frontend.conftest import REPO, start_frontend

ASSETS = REPO / "frontend" / "playground"


def test_the_page_and_its_assets_are_served(server):
    page = httpx.get(server.base_url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.text == (ASSETS / "index.html").read_text()
    referenced = re.findall(r'(?:src|href)="(/playground/[^"]+)"', page.text)
    assert sorted(referenced) == ["/playground/live_metrics.js", "/playground/markdown.js",
                                  "/playground/playground.css", "/playground/playground.js"]
    for path in referenced:
        asset = httpx.get(server.base_url + path, timeout=30)
        assert asset.status_code == 200, path
        assert asset.content == (ASSETS / path.rsplit("/", 1)[1]).read_bytes()
        assert asset.headers["content-type"].split(";")[0] == ("text/css" if path.endswith(".css")
                                                               else "text/javascript")


def test_a_missing_asset_is_a_404_in_the_api_error_shape(server):
    response = httpx.get(server.base_url + "/playground/nope.js", timeout=30)
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"
    assert httpx.get(server.base_url + "/playground/../api_server.py", timeout=30).status_code == 404


def test_the_page_stays_open_under_an_api_key_while_v1_is_closed(server, tmp_path):
    frontend, base_url, _ = start_frontend([*server.frontend_args, "--api-key", "sekret"], tmp_path / "f.log")
    try:
        assert httpx.get(base_url + "/", timeout=30).status_code == 200
        assert httpx.get(base_url + "/playground/playground.js", timeout=30).status_code == 200
        assert httpx.get(base_url + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(base_url + "/v1/models", headers={"Authorization": "Bearer sekret"},
                         timeout=30).status_code == 200
    finally:
        frontend.stop()


def test_disable_playground_removes_the_page(server, tmp_path):
    from pagedserve.serve import build_parser as serve_parser
    from frontend.frontend_options import frontend_options_argv

    # `serve` hands the switch (or PAGEDSERVE_DISABLE_PLAYGROUND) on to its frontends.
    assert "--disable-playground" in frontend_options_argv(serve_parser().parse_args(["--disable-playground"]))
    assert "--disable-playground" not in frontend_options_argv(serve_parser().parse_args([]))
    frontend, base_url, _ = start_frontend([*server.frontend_args, "--disable-playground"], tmp_path / "f.log")
    try:
        for path in ("/", "/playground/playground.js"):
            response = httpx.get(base_url + path, timeout=30)
            assert response.status_code == 404, path
        assert httpx.get(base_url + "/v1/models", timeout=30).status_code == 200
        assert "playground page on" not in frontend.log()
    finally:
        frontend.stop()


def test_every_asset_is_in_the_package_data():
    """A wheel holds only the files pyproject's package-data names."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["frontend"]
    for asset in ASSETS.iterdir():
        assert any(fnmatch.fnmatch(f"playground/{asset.name}", pattern) for pattern in patterns), asset.name
