"""The console in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, put in place by ``make install``) driven by selenium, against a gateway
served over HTTP with a stand-in engine behind it, and the openai SDK as the tenant's client.

One story: sign in, create a tenant, give it a money budget, create a key (shown once), use it
through the SDK, watch the usage chart and the budget bar move, revoke the key and see its
next request refused; then the tenant's own view. Every page is saved as a screenshot under
``TOLLWAY_CONSOLE_SCREENSHOTS`` (default: the test's tmp path), the source of docs/console/.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.storage.api_keys import hash_key
from tests.support.polling import wait_until
from tests.support.stand_in_engine import MODEL
from tests.support.stand_in_stack import gateway, stand_in_engine, stand_in_settings

pytestmark = pytest.mark.e2e
webdriver = pytest.importorskip("selenium.webdriver")
By = pytest.importorskip("selenium.webdriver.common.by").By
WebDriverWait = pytest.importorskip("selenium.webdriver.support.wait").WebDriverWait
staleness_of = pytest.importorskip("selenium.webdriver.support.expected_conditions").staleness_of

ADMIN_KEY = "admin-" + "b" * 40
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
WINDOW = (1280, 960)


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (make install puts them in place)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", f"--window-size={WINDOW[0]},{WINDOW[1]}"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("TOLLWAY_CONSOLE_SCREENSHOTS") or tmp_path / "console-screens")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def base_url(sqlite_db_url: str, tmp_path: Path) -> Iterator[str]:
    with stand_in_engine(num_chunks=6) as engine:
        settings = stand_in_settings(
            engine, tmp_path, sqlite_db_url, admin_key_hash=hash_key(ADMIN_KEY)
        )
        with gateway(settings) as url:
            yield url


class Pages:
    """The browser on the console: open, fill, submit, save a screenshot."""

    def __init__(self, driver: Any, base_url: str, screenshots: Path) -> None:
        self.driver, self.base_url, self.screenshots = driver, base_url, screenshots
        self.visited: list[str] = []

    def open(self, path: str) -> None:
        self.driver.get(self.base_url + path)
        self.visited.append(self.driver.current_url)

    def fill(self, field_id: str, value: str) -> None:
        element = self.driver.find_element(By.ID, field_id)
        element.clear()
        element.send_keys(value)

    def submit(self, form_id: str) -> None:
        self.click(f"#{form_id} button[type=submit]")

    def click(self, selector: str) -> None:
        """Click and wait for the page it loads (the old page's element goes stale)."""
        button = self.driver.find_element(By.CSS_SELECTOR, selector)
        button.click()
        WebDriverWait(self.driver, 30).until(staleness_of(button))
        self.visited.append(self.driver.current_url)

    def text(self, element_id: str) -> str:
        return str(self.driver.find_element(By.ID, element_id).text)

    def save(self, name: str) -> None:
        """The whole page (the window grown to its height for the shot)."""
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(WINDOW[0], max(WINDOW[1], int(height) + 140))
        try:
            assert self.driver.save_screenshot(str(self.screenshots / f"{name}.png"))
        finally:
            self.driver.set_window_size(*WINDOW)

    def bar_percent(self, level: str, unit: str) -> float:
        bar = self.driver.find_element(
            By.CSS_SELECTOR, f'tr.budget[data-level="{level}"][data-unit="{unit}"] svg'
        )
        return float(bar.get_attribute("data-used-percent"))


def chat(base_url: str, key: str, user: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "count to six"}],
        user=user,
        max_tokens=16,
    )
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 6


def test_an_admin_budgets_a_tenant_and_watches_its_key_spend(
    browser: Any, base_url: str, screenshots: Path
) -> None:
    ui = Pages(browser, base_url, screenshots)
    ui.open("/ui/")
    assert browser.current_url.endswith("/ui/sign-in")
    ui.save("sign-in")
    ui.fill("api_key", ADMIN_KEY)
    ui.submit("sign-in")
    assert browser.current_url.endswith("/ui/tenants")

    ui.fill("tenant-id", "acme")
    ui.fill("tenant-name", "Acme Corp")
    ui.submit("create-tenant")
    assert browser.current_url.endswith("/ui/tenants/acme")
    ui.fill("budget_money", "0.0005")  # 500 micros; a request here costs about 30
    ui.submit("quota-form")
    assert ui.bar_percent("tenant", "micros") == 0.0
    ui.fill("key-name", "sdk")
    ui.submit("create-key")
    key = ui.text("new-key-value")
    assert key.startswith("tw-")
    ui.save("tenant-new-key")
    ui.open("/ui/tenants/acme")
    assert key not in browser.page_source  # shown once

    for user in ("alice", "alice", "bob"):
        chat(base_url, key, user)

    def bar_moved() -> bool:
        ui.open("/ui/tenants/acme")
        return ui.bar_percent("tenant", "micros") > 0

    wait_until(bar_moved, 30, "the money budget's bar moved")
    used = ui.bar_percent("tenant", "micros")
    assert 0 < used < 100
    assert "alice" in ui.text("end-users")
    ui.fill("amount", "0.001")
    ui.fill("end_user", "alice")
    browser.find_element(By.CSS_SELECTOR, "#scope option[value=user]").click()
    ui.submit("budget-form")
    assert ui.bar_percent("user", "micros") > 0
    ui.save("tenant")

    ui.open("/ui/tenants")
    assert "Acme Corp" in ui.text("tenants")
    ui.save("tenants")
    ui.open("/ui/usage?window=1h")
    chart = browser.find_element(By.ID, "tokens-chart")
    assert chart.find_elements(By.CSS_SELECTOR, "rect")  # a bar for this hour's tokens
    assert "3</strong> requests" in browser.find_element(By.ID, "usage-totals").get_attribute(
        "innerHTML"
    )
    ui.save("usage")
    ui.open("/ui/fleet")
    assert MODEL in browser.page_source
    ui.save("fleet")

    ui.open("/ui/tenants/acme")
    ui.click("#keys form button.danger")
    assert "revoked" in ui.text("keys")
    with pytest.raises(openai.AuthenticationError):
        chat(base_url, key, "alice")
    ui.open("/ui/audit")
    audit = ui.text("audit")
    for action in ("tenant.created", "quota.replaced", "key.created", "budget.set", "key.revoked"):
        assert action in audit
    ui.save("audit")

    ui.open("/ui/tenants/acme")
    ui.fill("key-name", "viewer")
    ui.submit("create-key")
    viewer_key = ui.text("new-key-value")
    ui.click("form.sign-out button")
    assert browser.current_url.endswith("/ui/sign-in")
    ui.fill("api_key", viewer_key)
    ui.submit("sign-in")
    assert browser.current_url.endswith("/ui/my")
    assert "Acme Corp" in browser.page_source
    ui.save("tenant-view")
    ui.open("/ui/tenants")
    assert "403" in browser.title

    ui.open("/ui/tenants")
    for secret in (ADMIN_KEY, key, viewer_key):
        assert not any(secret in url for url in ui.visited)
    assert all(re.match(r"http://127\.0\.0\.1:\d+/ui/", url) for url in ui.visited)
    assert sorted(p.name for p in screenshots.glob("*.png")) == sorted(
        f"{name}.png"
        for name in (
            "sign-in",
            "tenants",
            "tenant-new-key",
            "tenant",
            "usage",
            "fleet",
            "audit",
            "tenant-view",
        )
    )
