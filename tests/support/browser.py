"""Debian's Chromium for the console's browser tests: its flags, screenshots, axe-core."""

from __future__ import annotations

from pathlib import Path

from support.paths import REPO

CHROMIUM = "/usr/bin/chromium"
# Headless as root on a closed network: no sandbox (root), no GPU, nothing that phones home.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = REPO / "build" / "console-screenshots"  # git-ignored; each test run rewrites them
# The rules axe-core runs: WCAG 2.0, 2.1 and 2.2 A and AA, and its best practices.
AXE_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "wcag22aa", "best-practice"]


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def serious_violations(page) -> list[str]:
    """axe-core's serious and critical violations on the page, one line each."""
    from axe_playwright_python.sync_playwright import Axe

    results = Axe().run(page, options={"runOnly": {"type": "tag", "values": AXE_TAGS}})
    return [f"{v['id']} ({v['impact']}): {v['help']} at {[n['target'] for n in v['nodes']][:3]}"
            for v in results.response["violations"] if v["impact"] in ("serious", "critical")]


def checked(page, name: str) -> None:
    """Screenshot the page and assert axe finds nothing serious on it."""
    screenshot(page, name)
    found = serious_violations(page)
    assert not found, f"{name}: " + "; ".join(found)
