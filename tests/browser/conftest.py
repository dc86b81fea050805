"""Headless Chromium driven by selenium, for tests of the playground page.

Debian's `chromium` and `chromium-driver` are installed here (apt-get) when
missing; the tests skip, saying why, only when that is impossible (no apt-get,
not root, or the install failed)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

CHROMIUM_PACKAGES = ["chromium", "chromium-driver"]


def _chromium_paths() -> tuple[str | None, str | None]:
    return shutil.which("chromium"), shutil.which("chromedriver")


def ensure_chromium() -> tuple[str, str]:
    """(chromium, chromedriver) paths, installing the Debian packages first when they are missing."""
    browser, driver = _chromium_paths()
    if browser and driver:
        return browser, driver
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium and chromium-driver are missing and cannot be installed here (needs root and "
                    "apt-get): install them, e.g. `apt-get install chromium chromium-driver`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *CHROMIUM_PACKAGES]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            pytest.skip(f"could not install chromium ({' '.join(command)} failed): {result.stderr.strip()[-500:]}")
    browser, driver = _chromium_paths()
    if not (browser and driver):
        pytest.skip("apt-get installed chromium but chromium/chromedriver are still not on PATH")
    return browser, driver


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium WebDriver (1280x860 window)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is missing: pip install -e '.[test]'")
    chromium, chromedriver = ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1280,860", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    # The given driver path: selenium must not try to download one (no network in tests).
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=chromedriver))
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
