"""The browser tier's browser: Debian's chromium and chromedriver (paths overridable with
GPUCOORD_TEST_CHROMIUM and GPUCOORD_TEST_CHROMEDRIVER), driven by Selenium with the driver's path given, so
that nothing is downloaded."""
from __future__ import annotations

import os
import shutil
from typing import Any

CHROMIUM = os.environ.get("GPUCOORD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("GPUCOORD_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")


def missing() -> str:
    """What the tier lacks, in a few words ("" when nothing)."""
    try:
        import selenium  # noqa: F401 - only whether it can be imported
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)) and shutil.which(path) is None:
            return f"{path} not found (apt-get install {package})"
    return ""


def start() -> Any:
    """A headless chromium, 1400 x 900 to begin with."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
