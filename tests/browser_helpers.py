"""Finding the browser the headless-Chromium tests drive through Playwright (no browser download)."""

from __future__ import annotations

import os
import shutil


def find_chromium() -> str | None:
    """Debian's chromium (scripts/setup.sh installs it with apt-get); MINICPMO_CHROMIUM overrides."""
    for candidate in (os.environ.get("MINICPMO_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        found = candidate and shutil.which(candidate)
        if found:
            return found
    return None
