"""The browser tier: one headless chromium for the session (``tests.support.browser``)."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.support import browser as chromium


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    driver = chromium.start()
    try:
        yield driver
    finally:
        driver.quit()
