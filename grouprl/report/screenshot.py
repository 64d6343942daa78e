"""A report rendered to PNG by headless Chromium (``grouprl report RUN_DIR --screenshot PNG``).

Chromium runs with no network and no first-run or background work: on a closed network a
Chromium that tries to reach its services waits for them. The same flags serve the browser
tests (tests/core/test_report_browser.py).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars")


class BrowserNotFound(RuntimeError):
    """No Chromium on PATH."""


def chromium_path() -> str | None:
    """The first of :data:`CHROMIUM_NAMES` on PATH, or None."""
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


def screenshot(report: str | Path, png: str | Path, *, width: int = 1400, height: int = 2400,
               timeout: float = 120) -> Path:
    """Render the HTML file ``report`` into ``png`` (``width`` x ``height`` pixels, the top of the page)."""
    browser = chromium_path()
    if browser is None:
        raise BrowserNotFound(f"--screenshot needs Chromium ({' or '.join(CHROMIUM_NAMES)} on PATH; "
                              "Debian: apt-get install chromium)")
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="grouprl-chromium-") as profile:
        # the virtual time budget lets the charts draw before the picture is taken
        cmd = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
               "--virtual-time-budget=10000", f"--screenshot={png}", Path(report).resolve().as_uri()]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not png.is_file():
        raise RuntimeError(f"Chromium did not write {png} (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return png
