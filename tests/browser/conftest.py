"""The browser tier: Debian's chromium and chromedriver, driven by Selenium, headless, with the driver's path
given (nothing is downloaded). Without them every test of the tier skips, with one line saying what is
missing (``.ci/browser-tests`` installs them when it can)."""
from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import pytest

CHROMIUM = os.environ.get("GPUCOORD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("GPUCOORD_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")


def _missing() -> str:
    try:
        import selenium  # noqa: F401 - only whether it can be imported
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)) and shutil.which(path) is None:
            return f"{path} not found (apt-get install {package})"
    return ""


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    missing = _missing()
    if missing:
        pytest.skip(f"browser tier: no browser: {missing}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
