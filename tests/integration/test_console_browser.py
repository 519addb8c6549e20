"""The officers' console in a real browser: Debian's Chromium driven by Playwright, against
the session server (a real gateway, engine and Valkey whose trail real requests filled).
Every page is checked by axe-core (WCAG 2.2 A and AA and best practices: no serious or
critical violation) and screenshotted into build/console-screenshots/.

The first test is the default suite's fast representative; the officer's whole scenario is
marked `browser` (`make test-browser`)."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from support.browser import checked, screenshot
from support.console import CONSOLE_USER, trail

SCRIPT = Path(__file__).resolve().parents[2] / "gateway" / "console" / "verify_package.py"
BLOCKING_RULE = "promissory-guaranteed-returns-en"


def log_in(page, server, key: str) -> None:
    page.goto(f"{server.console_url}/login")
    page.get_by_label("Officer key").fill(key)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_load_state()


def test_login_and_search_in_a_real_browser_keyboard_first_and_accessible(server, chromium):
    page = chromium.new_page(viewport={"width": 1280, "height": 800})
    page.goto(f"{server.console_url}/login")
    checked(page, "login")
    page.keyboard.press("Tab")  # the first stop: the skip link, visible when focused
    focused = page.evaluate("() => [document.activeElement.textContent, "
                            "getComputedStyle(document.activeElement).outlineStyle]")
    assert focused[0] == "Skip to the content" and focused[1] != "none"
    page.keyboard.press("Tab")
    page.keyboard.type(server.key("officer"))
    page.keyboard.press("Enter")  # the form is sent from the keyboard
    page.wait_for_url("**/search")
    assert page.get_by_role("heading", level=1).inner_text() == "Search conversations"
    checked(page, "search")


@pytest.mark.browser
def test_an_officer_reviews_a_blocked_attempt_exports_and_proves_it(server, console_trail, chromium,
                                                                    tmp_path):
    audit_id = console_trail["blocked"]
    page = chromium.new_page(viewport={"width": 1280, "height": 800}, accept_downloads=True)

    log_in(page, server, server.key("app"))  # an app key is refused, and says why
    assert "not an officer key" in page.get_by_role("alert").inner_text()
    assert not page.context.cookies()[0]["name"].endswith("session")
    checked(page, "login-refused")

    log_in(page, server, server.key("officer"))
    page.get_by_label("Rule").fill(BLOCKING_RULE)
    page.get_by_label("User", exact=True).fill(CONSOLE_USER)
    page.get_by_role("button", name="Search").click()
    row = page.get_by_role("row").filter(has=page.get_by_role("link", name=audit_id, exact=True))
    assert f"{BLOCKING_RULE}: block" in row.inner_text()
    checked(page, "search-by-rule")

    row.get_by_role("link", name=audit_id, exact=True).click()
    page.wait_for_url(f"**/conversation/{audit_id}")
    marker = page.get_by_role("link", name="[1 never delivered]")
    assert marker.is_visible()
    note = page.locator("#note-1")
    assert BLOCKING_RULE in note.inner_text() and "Never delivered:" in note.inner_text()
    assert "guaranteed returns" in note.locator("del").inner_text()
    assert "✓ verified" in page.get_by_role("status").inner_text()
    checked(page, "conversation")
    marker.focus()
    page.keyboard.press("Enter")  # the marker leads to its note
    assert page.url.endswith("#note-1")

    page.get_by_label("Reviewed").check()
    page.get_by_label("Comment").fill("Rolled back before delivery; nothing to remediate.")
    page.get_by_role("button", name="Record the decision").click()
    page.wait_for_url(f"**/conversation/{audit_id}#reviews")
    assert "Rolled back before delivery" in page.get_by_role("table").inner_text()
    assert trail(server, "subject", audit_id)[-1]["decision"] == "reviewed"
    page.set_viewport_size({"width": 768, "height": 1024})  # a tablet
    checked(page, "conversation-tablet")
    page.set_viewport_size({"width": 1280, "height": 800})

    page.goto(f"{server.console_url}/search?rule={BLOCKING_RULE}&user={CONSOLE_USER}")
    assert "reviewed" in page.get_by_role("row").filter(has_text=audit_id).first.inner_text()
    with page.expect_download() as download:
        page.get_by_role("link", name="CSV").click()
    exported = tmp_path / "search.csv"
    download.value.save_as(exported)
    rows = list(csv.DictReader(exported.open()))
    assert any(r["audit_id"] == audit_id and r["review"] == "reviewed" for r in rows)

    page.goto(f"{server.console_url}/package")
    checked(page, "package")
    page.get_by_label("From").fill(time.strftime("%Y-%m-%d", time.gmtime()))
    with page.expect_download() as download:
        page.get_by_role("button", name="Download the package").click()
    package = tmp_path / "package.zip"
    download.value.save_as(package)
    with zipfile.ZipFile(package) as z:
        assert any(n.endswith("verify_package.py") for n in z.namelist())
    offline = subprocess.run([sys.executable, "-I", str(SCRIPT), str(package), "--key-file",
                              str(server.state / "audit.key")], capture_output=True, text=True)
    assert offline.returncode == 0 and "package intact" in offline.stdout, offline.stdout

    for path, name in (("/queue", "queue"), ("/rules", "rules"), ("/holds", "holds"),
                       ("/rescan", "rescan")):
        page.goto(server.console_url + path)
        checked(page, name)
    page.get_by_role("link", name="Rules over time").click()
    versions = page.get_by_role("table", name="Policy versions, oldest first").get_by_role("link")
    versions.first.click()
    assert page.locator(f"#rule-{BLOCKING_RULE}").is_visible()
    checked(page, "rules-of-a-version")

    page.goto(f"{server.console_url}/rescan")
    page.get_by_label("Draft rule pack (YAML)").fill(
        "rules:\n  - id: draft-still-valid\n    description: d\n    kind: literal\n"
        "    patterns: [still valid]\n    scope: input\n    action: block\n")
    page.get_by_label("User", exact=True).fill(CONSOLE_USER)
    page.get_by_role("button", name="Re-scan").click()
    assert "draft-still-valid" in page.get_by_role("table").inner_text()
    checked(page, "rescan-result")

    page.get_by_role("link", name="Who looked at what").click()
    history = page.get_by_role("table", name="Access records").inner_text()
    for event in ("console_search", "console_conversation", "console_export", "console_package_built",
                  "console_rescan"):
        assert event in history, event
    checked(page, "history")
    screenshot(page, "history-final")
