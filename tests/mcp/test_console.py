"""The on-call web console in a real browser: headless Chromium driven by Selenium, against real
onced processes on SQLite and PostgreSQL, with UNKNOWN refunds made by refund-mcp against
fakepay. Every page the suite visits is saved as a screenshot under target/console/."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import anyio
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from conftest import BIN, PATIENCE, ROOT, make_stack, wait_for

pytestmark = pytest.mark.anyio

SCREENSHOTS = ROOT / "target" / "console"
# axe-core, installed by `make test` from tests/mcp/a11y's lock file.
AXE = ROOT / "tests" / "mcp" / "a11y" / "node_modules" / "axe-core" / "axe.min.js"
# The rules every page must pass: WCAG 2.1, levels A and AA (labels, contrast, landmarks, names).
WCAG = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]
# How long a page may take to show what the test waits for.
WAIT = 15 * PATIENCE


@pytest.fixture
def console_stack(tmp_path, backend):
    """Two tenants, acme and globex, a ledger that requires keys and serves its console, and
    acme's refund-mcp over Streamable HTTP."""
    stack = make_stack(tmp_path, backend, "none", reconcile=False, tenants=("acme", "globex"), console=True)
    try:
        stack.acme_mcp = stack.start_tenant_refund_http("acme")
        stack.reader_key = new_key(stack, "acme", "acme-reader", "reader")
        stack.operator_key = new_key(stack, "acme", "acme-oncall", "operator,reader")
        yield stack
    finally:
        stack.close()


def new_key(stack, tenant: str, name: str, roles: str) -> str:
    """A key made on the database while the ledger serves, once the ledger knows it (it reads
    the credentials again within --credential-ttl)."""
    key = stack.create_key(tenant, name, roles)
    wait_for(f"the ledger to know {name}", lambda: run_oncectl(stack, key, "status").returncode == 0)
    return key


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--window-size=1280,900", f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        yield driver
    finally:
        driver.quit()


def base(stack) -> str:
    return f"http://127.0.0.1:{stack.console_port}"


def shot(driver, name: str, backend: str) -> None:
    """Saves the page as a screenshot, and checks it with axe-core: in light mode, and again in
    dark mode (both follow the system)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SCREENSHOTS / f"{name}-{backend}.png"))
    assert AXE.exists(), f"{AXE} is missing: make test installs it (npm ci in tests/mcp/a11y)"
    for scheme in ("light", "dark"):
        driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": scheme}]}
        )
        driver.execute_script(AXE.read_text())
        violations = driver.execute_async_script(
            """
            const [tags, done] = arguments;
            axe.run(document, {runOnly: {type: "tag", values: tags}}).then(
                result => done(result.violations.map(v =>
                    `${v.id} (${v.impact}): ${v.help}: ${v.nodes.map(n => n.target.join(" ")).join(", ")}`)),
                error => done([`axe failed: ${error}`]));
            """,
            WCAG,
        )
        assert not violations, f"{name} in {scheme} mode: " + "; ".join(violations)
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


async def make_unknown(stack, order_id: str, fault: str = "commit_then_drop") -> str:
    """A refund whose answer is lost (by default the provider commits it and drops the
    connection): UNKNOWN. Returns its operation id."""
    stack.faults(write=fault)
    async with stack.session_at(stack.acme_mcp) as session:
        arguments = {"order_id": order_id, "amount_cents": 500, "currency": "eur"}
        result = await session.call_tool("issue_refund", arguments)
        assert result.is_error and "being verified" in result.content[0].text
        stack.faults()
        status = await session.call_tool("get_refund_status", {"order_id": order_id})
    seen = json.loads(status.content[0].text)
    assert seen["state"] == "UNKNOWN", seen
    return seen["operation_id"]


def sign_in(driver, stack, key: str) -> None:
    driver.get(base(stack) + "/sign-in")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "form[action='/sign-in'] button").click()
    WebDriverWait(driver, WAIT).until(lambda d: d.current_url.endswith("/queue"))


def queue_ids(driver) -> set[str]:
    # Read in one step: the live page may swap the table in between two reads.
    return set(driver.execute_script(
        "return [...document.querySelectorAll('tr[data-operation]')].map(row => row.dataset.operation);"
    ))


def post_from_page(driver, path: str, fields: dict) -> tuple[int, str]:
    """POSTs a form from inside the signed-in page (same origin, the page's session cookie)
    and returns the status and the body."""
    return tuple(driver.execute_async_script(
        """
        const [path, fields, done] = arguments;
        fetch(path, {method: "POST", body: new URLSearchParams(fields), credentials: "same-origin"})
            .then(r => r.text().then(t => done([r.status, t])), e => done([0, String(e)]));
        """,
        path, fields,
    ))


def page_csrf(driver) -> str:
    return driver.find_element(By.CSS_SELECTOR, "form[action='/sign-out'] input[name=csrf]").get_attribute("value")


def operation_url(stack, operation_id: str) -> str:
    return base(stack) + "/operation?id=" + urllib.parse.quote(operation_id, safe="")


async def refund_state(stack, order_id: str) -> dict:
    async with stack.session_at(stack.acme_mcp) as session:
        status = await session.call_tool("get_refund_status", {"order_id": order_id})
    return json.loads(status.content[0].text)


async def test_a_reader_sees_the_queue_live_and_cannot_act(console_stack, browser, backend):
    stack = console_stack
    first = await make_unknown(stack, "order_1")
    sign_in(browser, stack, stack.reader_key)
    assert first in queue_ids(browser)
    assert "acme-reader" in browser.find_element(By.CSS_SELECTOR, ".session").text
    shot(browser, "queue", backend)
    # On a phone: nothing but a wide table scrolls sideways, and the page still passes.
    browser.set_window_size(390, 844)
    WebDriverWait(browser, WAIT).until(lambda d: d.execute_script("return window.innerWidth") <= 400)
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth;"
    ), browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth];")
    shot(browser, "queue-phone", backend)
    browser.set_window_size(1280, 900)

    # A new UNKNOWN appears without a reload (the marker set on this page survives), carried
    # by the one event stream the page opened.
    browser.execute_script("window.__same_page = true;")
    WebDriverWait(browser, WAIT).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "p.live").text.startswith("Live")
    )
    second = await make_unknown(stack, "order_2")
    WebDriverWait(browser, WAIT).until(lambda d: second in queue_ids(d))
    assert browser.execute_script("return window.__same_page === true;")
    assert browser.find_element(By.CSS_SELECTOR, "p.live").get_attribute("data-opens") == "1"
    shot(browser, "queue-live", backend)

    # The overview: what is UNKNOWN now, and how old, drawn as a chart by the server.
    browser.get(base(stack) + "/overview?window=1h")
    # Read in one step: the live page swaps its figures in when its stream opens.
    count, chart, text = browser.execute_script(
        "return [document.getElementById('unknown-count').dataset.count,"
        " document.querySelector('figure.chart svg').getAttribute('aria-label'),"
        " document.querySelector('main').innerText];"
    )
    assert count == "2" and "< 1 min: 2" in chart, (count, chart)
    assert "issue_refund" in text
    shot(browser, "overview", backend)
    browser.get(base(stack) + "/queue")

    # The operation's page: its timeline, its attempt and where it came from; no act button.
    link = browser.execute_script(
        "return [...document.querySelectorAll('tr[data-operation] a')].find(a => a.textContent === arguments[0]).href;",
        first,
    )
    browser.get(link)
    WebDriverWait(browser, WAIT).until(lambda d: "Timeline" in d.page_source)
    text = browser.find_element(By.TAG_NAME, "main").text
    assert "REPORTED_UNKNOWN" in text and "UNKNOWN" in text
    assert "Attempts" in text and "refund-mcp" in text
    assert not browser.find_elements(By.CSS_SELECTOR, "section.acts")
    shot(browser, "operation-reader", backend)

    # A resolve forged from the reader's own page (its origin, its session's token) is refused
    # by the ledger's role check, and nothing changes.
    fields = {
        "csrf": page_csrf(browser), "id": first, "outcome": "ABSENT", "reason": "forged",
        "fencing_token": "1", "attempt": "1", "confirmed": "yes", "resolution_id": "forged-1",
    }
    status, body = post_from_page(browser, "/operation/resolve", fields)
    assert status == 403 and "Not allowed" in body and "operator" in body, body
    assert (await refund_state(stack, "order_1"))["state"] == "UNKNOWN"
    assert stack.stats()["refunds"] == 2


async def test_an_operator_resolves_and_a_stale_page_is_refused(console_stack, browser, backend):
    stack = console_stack
    settled = await make_unknown(stack, "order_settled")
    # A provider failure before it stored anything: UNKNOWN to the server all the same.
    stale = await make_unknown(stack, "order_stale", fault="fail_before_commit")
    sign_in(browser, stack, stack.operator_key)

    # Resolve CONFIRMED with the refund the provider holds: review, then confirm.
    browser.get(operation_url(stack, settled))
    shot(browser, "operation-operator", backend)
    refund = {"refund_id": "re_console", "status": "succeeded", "amount_cents": 500}
    browser.find_element(By.CSS_SELECTOR, "input[name=outcome][value=CONFIRMED]").click()
    browser.find_element(By.ID, "result").send_keys(json.dumps(refund))
    browser.find_element(By.ID, "provider_ref").send_keys("re_console")
    browser.find_element(By.ID, "reason").send_keys("fakepay dashboard shows re_console for order_settled")
    browser.find_element(By.CSS_SELECTOR, "form.resolve button").click()
    WebDriverWait(browser, WAIT).until(lambda d: "Resolve CONFIRMED" in d.page_source)
    assert "never executed again" in browser.find_element(By.TAG_NAME, "main").text
    shot(browser, "resolve-confirm", backend)
    browser.find_element(By.XPATH, "//button[text()='Resolve CONFIRMED']").click()
    WebDriverWait(browser, WAIT).until(lambda d: "Resolved: the operation is CONFIRMED" in d.page_source)
    main = browser.find_element(By.TAG_NAME, "main").text
    assert "RESOLVED" in main and "operator:acme-oncall" in main

    # The next Begin of that refund replays what the operator resolved, and pays nothing.
    async with stack.session_at(stack.acme_mcp) as session:
        again = await session.call_tool(
            "issue_refund", {"order_id": "order_settled", "amount_cents": 500, "currency": "eur"}
        )
    assert not again.is_error, again.content[0].text
    assert json.loads(again.content[0].text) == refund
    assert stack.stats()["refunds"] == 1

    # A page that went stale: while it is open, a lead settles the operation ABSENT, the next
    # call runs a new attempt, and that one is UNKNOWN too. The page's resolution was bound to
    # the first attempt: it must not settle the second.
    browser.get(operation_url(stack, stale))
    browser.find_element(By.CSS_SELECTOR, "input[name=outcome][value=ABSENT]").click()
    browser.find_element(By.ID, "reason").send_keys("no refund at the provider")
    browser.find_element(By.CSS_SELECTOR, "form.resolve button").click()
    WebDriverWait(browser, WAIT).until(lambda d: "Resolve ABSENT" in d.page_source)
    oncectl(stack, stack.operator_key, "resolve", stale, "--absent", "--reason", "nothing at the provider",
            "--operator", "lead", "--yes")
    await unknown_again_after_a_crash(stack, "order_stale")
    browser.find_element(By.XPATH, "//button[text()='Resolve ABSENT']").click()
    WebDriverWait(browser, WAIT).until(lambda d: "Nothing was applied" in d.page_source)
    main = browser.find_element(By.TAG_NAME, "main").text
    assert "It is UNKNOWN at attempt 2" in main, main
    shot(browser, "resolve-stale", backend)
    now = await refund_state(stack, "order_stale")
    assert now["state"] == "UNKNOWN" and now["attempts"][-1]["attempt"] == 2, now


async def unknown_again_after_a_crash(stack, order_id: str) -> None:
    """The next call of a refund settled ABSENT runs a new attempt; refund-mcp is killed while
    the provider is answering it, and the attempt's lease ends UNKNOWN."""
    stack.faults(delay_ms=5000)

    async def call() -> None:
        with contextlib.suppress(Exception):
            async with stack.session_at(stack.acme_mcp) as session:
                arguments = {"order_id": order_id, "amount_cents": 500, "currency": "eur"}
                await session.call_tool("issue_refund", arguments)

    async with anyio.create_task_group() as group:
        group.start_soon(call)
        with anyio.fail_after(WAIT):
            while (await refund_state(stack, order_id))["state"] != "IN_FLIGHT":
                await anyio.sleep(0.05)
        stack.kill_refund_mcp()
        group.cancel_scope.cancel()
    stack.faults()
    stack.acme_mcp = stack.start_tenant_refund_http("acme")
    with anyio.fail_after(WAIT):
        while (await refund_state(stack, order_id))["state"] != "UNKNOWN":
            await anyio.sleep(0.05)


async def test_text_from_the_ledger_is_shown_never_run(console_stack, browser, backend):
    stack = console_stack
    hostile = await make_unknown(stack, "order_hostile")
    reason = '<img src=x onerror="document.title=\'owned\'"><script>document.title="owned"</script>'
    oncectl(stack, stack.operator_key, "resolve", hostile, "--absent", "--reason", reason,
            "--operator", "<b>lead</b>", "--yes")
    sign_in(browser, stack, stack.reader_key)
    browser.get(operation_url(stack, hostile))
    main = browser.find_element(By.TAG_NAME, "main")
    assert reason in main.text
    assert not main.find_elements(By.TAG_NAME, "img") and not main.find_elements(By.TAG_NAME, "b")
    assert browser.title != "owned"


async def test_open_mode_opens_without_sign_in_and_says_so(tmp_path, backend, browser):
    stack = make_stack(tmp_path, backend, "none", reconcile=False, console=True)
    try:
        browser.get(base(stack) + "/queue")
        assert browser.current_url.endswith("/queue")
        assert "Open mode" in browser.find_element(By.CSS_SELECTOR, ".banner").text
        assert "No UNKNOWN operation" in browser.find_element(By.TAG_NAME, "main").text
        shot(browser, "queue-open-mode", backend)
    finally:
        stack.close()


def run_oncectl(stack, key: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "oncectl"), "--addr", f"http://127.0.0.1:{stack.ledger_port}", *args],
        capture_output=True, text=True, env={"ONCE_KEY": key, "PATH": "/usr/bin:/bin", "HOME": str(stack.tmp)},
    )


def oncectl(stack, key: str, *args: str) -> str:
    done = run_oncectl(stack, key, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def request(stack, method: str, path: str, headers: dict, body: dict | None = None) -> int:
    data = urllib.parse.urlencode(body).encode() if body is not None else None
    req = urllib.request.Request(base(stack) + path, data=data, method=method, headers=headers)
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(req, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


async def test_tenants_origins_hosts_and_revoked_keys_are_kept_out(console_stack, browser, backend):
    stack = console_stack
    acme = await make_unknown(stack, "order_acme")
    globex_key = new_key(stack, "globex", "globex-oncall", "operator,reader")

    # Another tenant's key sees none of acme's operations, and cannot open one.
    sign_in(browser, stack, globex_key)
    assert acme not in queue_ids(browser)
    browser.get(operation_url(stack, acme))
    assert "Not found" in browser.find_element(By.TAG_NAME, "h1").text
    globex_cookie = browser.get_cookie("once_console")
    assert globex_cookie["httpOnly"] and globex_cookie["sameSite"] == "Strict"

    # A cross-site form POST, even carrying the session cookie and its token, is refused; so is
    # a request naming another Host.
    sign_in(browser, stack, stack.operator_key)
    cookie = f"once_console={browser.get_cookie('once_console')['value']}"
    csrf = page_csrf(browser)
    path = "/operation/reconcile"
    own_origin = base(stack)
    form = {"csrf": csrf, "id": acme}
    assert request(stack, "POST", path, {"Cookie": cookie, "Origin": "https://evil.example"}, form) == 403
    assert request(stack, "POST", path, {"Cookie": cookie}, form) == 403
    assert request(stack, "POST", path, {"Cookie": cookie, "Origin": own_origin}, {**form, "csrf": "wrong"}) == 403
    # The same request from the console's own origin passes the edge and reaches the ledger,
    # which has no reconciler for it.
    assert request(stack, "POST", path, {"Cookie": cookie, "Origin": own_origin}, form) == 409
    assert request(stack, "GET", "/queue", {"Cookie": cookie, "Host": "evil.example"}) == 421
    assert request(stack, "GET", "/queue", {"Cookie": cookie}) == 200
    # Without a session nothing is shown: the ledger requires keys.
    assert request(stack, "GET", "/queue", {}) == 303
    # A sign-in posted from another site is refused, whatever key it carries (login CSRF).
    signing_in = {"key": stack.reader_key, "next": "/queue"}
    assert request(stack, "POST", "/sign-in", {"Origin": "https://evil.example"}, signing_in) == 403
    assert request(stack, "POST", "/sign-in", {"Origin": own_origin}, signing_in) == 303

    # After sign-out the page's forms lead to sign-in, and act on nothing.
    status, _ = post_from_page(browser, "/sign-out", {"csrf": csrf})
    assert status == 200, "signing out leads to the sign-in page"
    assert request(stack, "POST", path, {"Cookie": cookie, "Origin": own_origin}, form) == 303

    # A revoked key's session ends: the next page asks to sign in again.
    sign_in(browser, stack, stack.reader_key)
    keys = json.loads(stack.onced_command("keys", "list", "--tenant", "acme", "--json"))
    reader = next(key for key in keys if key["name"] == "acme-reader")
    stack.onced_command("keys", "revoke", reader["key_id"])

    def signed_out(driver) -> bool:
        driver.get(base(stack) + "/queue")
        return "/sign-in" in driver.current_url

    WebDriverWait(browser, WAIT, poll_frequency=0.25).until(signed_out)
    shot(browser, "sign-in", backend)


# The stripe reconciler, whose workers wait an hour: only the console looks anything up. What it
# finds settles at once; a miss is proof of nothing for an hour, so it leaves the operation UNKNOWN.
BULK_CONFIG = (
    '[reconciliation]\ninterval = "1h"\n\n'
    '[[reconciler]]\nname = "stripe"\nkind = "stripe"\n'
    'endpoint = "{provider_url}"\nsettle_time = "1h"\ntenants = ["acme"]\n'
    'dashboard = "https://dashboard.fakepay.test/search?q={provider_key}"\n'
)


def outcomes(driver) -> dict[str, str]:
    """Each operation of a bulk action's outcome table, and its state after."""
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('tr[data-outcome]')]"
        ".map(row => [row.dataset.operation, row.dataset.state]));"
    )


async def test_an_operator_acts_on_a_filter_after_its_dry_run(tmp_path, backend, browser):
    stack = make_stack(tmp_path, backend, "none", reconcile=False, tenants=("acme",), console=True,
                       config=BULK_CONFIG)
    try:
        stack.acme_mcp = stack.start_tenant_refund_http("acme")
        key = new_key(stack, "acme", "acme-oncall", "operator,reader")
        # One refund the provider made (its answer lost), one it never stored.
        paid = await make_unknown(stack, "order_bulk_paid")
        unpaid = await make_unknown(stack, "order_bulk_unpaid", fault="fail_before_commit")
        moved = await make_unknown(stack, "order_bulk_moved", fault="fail_before_commit")
        sign_in(browser, stack, key)

        # The queue's filter, then its dry run: the list, and nothing done.
        browser.get(base(stack) + "/queue?provider=stripe")
        WebDriverWait(browser, WAIT).until(lambda d: queue_ids(d) == {paid, unpaid, moved})
        # By how they came to be UNKNOWN: each attempt said it could not tell; no lease ran out.
        browser.get(base(stack) + "/queue?provider=stripe&source=lease")
        WebDriverWait(browser, WAIT).until(lambda d: "No UNKNOWN operation matches" in d.page_source)
        Select(browser.find_element(By.NAME, "source")).select_by_value("attempt")
        browser.find_element(By.CSS_SELECTOR, "form.filters button").click()
        WebDriverWait(browser, WAIT).until(lambda d: queue_ids(d) == {paid, unpaid, moved})
        browser.find_element(By.LINK_TEXT, "Act on these…").click()
        WebDriverWait(browser, WAIT).until(lambda d: "dry run" in d.page_source)
        main = browser.find_element(By.TAG_NAME, "main").text
        assert "3 UNKNOWN operations selected" in main and "provider stripe" in main, main
        assert "where its attempt could not tell" in main, main
        assert queue_ids(browser) == {paid, unpaid, moved}
        shot(browser, "bulk-dry-run", backend)
        for order in ("order_bulk_paid", "order_bulk_unpaid", "order_bulk_moved"):
            assert (await refund_state(stack, order))["state"] == "UNKNOWN"

        # Reconcile them all: each outcome appears as it is done, then the tally.
        browser.find_element(By.CSS_SELECTOR, "form.bulk-reconcile button").click()
        WebDriverWait(browser, WAIT).until(lambda d: d.find_elements(By.ID, "bulk-finished"))
        main = browser.find_element(By.TAG_NAME, "main").text
        assert outcomes(browser) == {paid: "CONFIRMED", unpaid: "UNKNOWN", moved: "UNKNOWN"}, main
        assert "Finished: 3 done, 0 refused" in browser.find_element(By.ID, "bulk-finished").text
        shot(browser, "bulk-reconciled", backend)
        assert (await refund_state(stack, "order_bulk_paid"))["state"] == "CONFIRMED"

        # Each operation's page links to it in the provider's dashboard.
        browser.get(operation_url(stack, unpaid))
        link = browser.find_element(By.CSS_SELECTOR, "a.dashboard")
        assert link.get_attribute("href").startswith("https://dashboard.fakepay.test/search?q=once_"), \
            link.get_attribute("href")
        assert link.get_attribute("rel") == "noopener noreferrer"

        # The reconciler's health, on the overview: three lookups, one settled, two that found
        # nothing yet.
        browser.get(base(stack) + "/overview?window=1h")
        # Read in one step: the live page may swap its figures in between two reads.
        row = WebDriverWait(browser, WAIT).until(lambda d: d.execute_script(
            "const row = document.querySelector('tr[data-reconciler=stripe]'); return row && row.innerText;"))
        assert row.split()[:5] == ["stripe", "3", "1", "2", "0"], row
        shot(browser, "overview-reconcilers", backend)

        # What the provider could not tell, resolved ABSENT with one reason, after a review.
        browser.get(base(stack) + "/bulk?provider=stripe")
        WebDriverWait(browser, WAIT).until(lambda d: "2 UNKNOWN operations selected" in d.page_source)
        browser.find_element(By.ID, "bulk-reason").send_keys("fakepay holds no refund for these orders")
        browser.find_element(By.CSS_SELECTOR, "form.bulk-resolve button").click()
        WebDriverWait(browser, WAIT).until(lambda d: "Resolve 2 operations ABSENT?" in d.page_source)
        shot(browser, "bulk-resolve-confirm", backend)
        # Meanwhile a lead settles one of them: the page's resolution of it must not apply.
        oncectl(stack, key, "resolve", moved, "--absent", "--reason", "settled by the lead",
                "--operator", "lead", "--yes")
        browser.find_element(By.XPATH, "//button[text()='Resolve 2 ABSENT']").click()
        WebDriverWait(browser, WAIT).until(lambda d: d.find_elements(By.ID, "bulk-finished"))
        main = browser.find_element(By.TAG_NAME, "main").text
        assert outcomes(browser) == {unpaid: "ABSENT", moved: "—"}, main
        assert "Finished: 1 done, 1 refused" in main, main
        assert (await refund_state(stack, "order_bulk_unpaid"))["state"] == "ABSENT"
        lead = json.loads(oncectl(stack, key, "show", moved, "--json"))["events"][-1]
        assert (lead["actor"], lead["reason"]) == ("operator:lead@acme-oncall", "settled by the lead"), lead

        # Both actions are on the record with the operator and the key.
        shown = json.loads(oncectl(stack, key, "show", paid, "--json"))
        reconciled = [e for e in shown["events"] if e["kind"] == "RECONCILED"]
        assert reconciled and reconciled[-1]["details"]["asked_by"] == "operator:acme-oncall", shown
        shown = json.loads(oncectl(stack, key, "show", unpaid, "--json"))
        resolved = shown["events"][-1]
        assert resolved["actor"] == "operator:acme-oncall", resolved
        assert resolved["reason"] == "fakepay holds no refund for these orders", resolved
    finally:
        stack.close()
