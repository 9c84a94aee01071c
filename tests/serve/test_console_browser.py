"""The web console (docs/console.md) in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven
by selenium), against one live server on the embedded model (SmolLM2-135M) with tenants, an admin key and a usage database:

- Chat streams a reply (text appears while the request runs, then TTFT and tokens/s under it), and Stop aborts a
  long one: the server's running count drops to 0 and it generated far fewer tokens than asked; the export;
- Live: the charts update while a load runs (tokens/s and running requests above 0, roofline bars drawn); a
  tenant key gets the "internal or admin key" note instead;
- Usage: the admin sees every tenant and the limits table (and downloads the server's CSV), a tenant only its own
  rows and no limits;
- Bench: a saved `bench serve` result renders its summary table and plots, error text stays text, a file that is
  no result says so;
- a server error (a bad sampling field) is shown in the page;
- after every test: no console error (a tenant's 401/403 network entries excepted where the test asks for one)
  and no request to any host but 127.0.0.1.

Screenshots at 1280x800 go to the test's output folder (and to $TOKENMILL_CONSOLE_SHOTS when set: docs/img/console).
Skipped with the reason when selenium, chromium or chromedriver is missing (`apt-get install chromium
chromium-driver`)."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from server_harness import start_server

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
except ImportError:
    selenium = None
pytestmark = pytest.mark.skipif(
    selenium is None or CHROMIUM is None or CHROMEDRIVER is None,
    reason="browser tests need selenium (pip install '.[test]') and Debian's chromium + chromium-driver "
           "(apt-get install chromium chromium-driver)")

ADMIN = "sk-admin"
KEYS = """
tenants:
  - {name: team-a, keys: [sk-a]}
  - {name: team-b, keys: [sk-b], limits: {concurrent: 4, requests_per_minute: 600}}
"""
REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30  # every wait's deadline: generous for a loaded 2-core machine, never a fixed sleep


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("console")
    keys = root / "keys.yaml"
    keys.write_text(KEYS)
    # the embedded SmolLM2-135M (no model argument), served as "tiny": the chat streams a real model's reply
    srv = start_server(None, root / "server.log", "--served-model-name", "tiny", "--api-keys-file", str(keys),
                       "--admin-key", ADMIN, "--usage-db", str(root / "usage.db"), "--max-model-len", "4096",
                       "--kv-cache-memory-bytes", "192M")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> list[Path]:
    out = [tmp_path_factory.mktemp("console-shots")]
    if os.environ.get("TOKENMILL_CONSOLE_SHOTS"):
        out.append(Path(os.environ["TOKENMILL_CONSOLE_SHOTS"]))
        out[-1].mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,800", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-default-apps"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_window_size(1280, 800)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, what: str, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d), message=what)


def open_page(driver, server, page: str, key: str) -> None:
    """The console on its Bench tab (which calls no data route), the key typed into the form, then `page`'s tab."""
    driver.get(server.url("/#bench"))
    driver.execute_script("sessionStorage.clear()")
    driver.refresh()
    wait_for(driver, lambda d: d.find_element("id", "key-needed").is_displayed(), "the page asks for a key")
    el = driver.find_element("id", "key-input")
    el.clear()
    el.send_keys(key)
    driver.find_element("id", "key-use").click()
    wait_for(driver, lambda d: d.find_element("id", "key-state").text.endswith(key[-4:] + ")"), "key stored")
    assert driver.execute_script("return sessionStorage.getItem('tokenmill.key')") == key
    driver.find_element("css selector", f"#tabs a[data-page='{page}']").click()
    wait_for(driver, lambda d: d.find_element("id", "page-" + page).is_displayed(), page)


def shoot(driver, shots: list[Path], name: str) -> None:
    assert driver.get_window_size() == {"width": 1280, "height": 800}
    for folder in shots:
        driver.save_screenshot(str(folder / f"{name}.png"))
    assert (shots[0] / f"{name}.png").stat().st_size > 10_000


def check_clean(driver, allowed_statuses: tuple[int, ...] = ()) -> None:
    """No console error (a network entry for an allowed status excepted) and no request off 127.0.0.1."""
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    unexpected = [e for e in errors if not (e.get("source") == "network"
                                            and any(f"status of {s}" in e["message"] for s in allowed_statuses))]
    assert not unexpected, unexpected
    urls = set(driver.execute_script(
        "return performance.getEntriesByType('resource').concat(performance.getEntriesByType('navigation'))"
        ".map(e => e.name)"))
    for entry in driver.get_log("performance"):  # the CDP network log: every request the page made
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.add(message["params"]["request"]["url"])
    assert urls
    for url in urls:
        parsed = urlparse(url)
        assert parsed.scheme in ("data", "blob") or parsed.hostname == "127.0.0.1", url


def downloaded(driver, folder: Path, click_id: str, name: str) -> str:
    """Click a download button and read the file Chromium saved into `folder`."""
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(folder)})
    driver.find_element("id", click_id).click()
    path = folder / name
    wait_for(driver, lambda d: path.exists() and path.stat().st_size > 0, f"{name} downloaded")
    return path.read_text()


def metric(server, name: str) -> float:
    text = httpx.get(server.url("/metrics"), headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def wait_running_zero(server) -> None:
    deadline = time.monotonic() + WAIT_S
    while metric(server, "tokenmill:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the server still runs a request"
        time.sleep(0.05)  # a poll interval, bounded by the deadline above


def chat_settings(driver, max_tokens: int, extra: str) -> None:
    for field, value in (("chat-max-tokens", str(max_tokens)), ("chat-extra", extra), ("chat-seed", "1")):
        el = driver.find_element("id", field)
        el.clear()
        el.send_keys(value)


def send_chat(driver, text: str) -> None:
    driver.find_element("id", "chat-input").send_keys(text)
    driver.find_element("id", "chat-send").click()


def test_chat_streams_a_reply_and_stop_aborts(server, browser, shots, tmp_path_factory):
    open_page(browser, server, "chat", "sk-a")
    wait_for(browser, lambda d: d.execute_script("return document.getElementById('chat-model').value") == "tiny",
             "models listed")
    chat_settings(browser, 24, '{"ignore_eos": true}')
    send_chat(browser, "Say **hello** in `code`")
    done = wait_for(browser, lambda d: d.find_elements("css selector", ".msg.assistant[data-done='1']"), "reply")
    stats = done[-1].find_element("css selector", ".stats").text
    assert "TTFT" in stats and "tokens/s" in stats and "24 tokens" in stats and "length" in stats, stats
    assert done[-1].find_element("css selector", ".body").text.strip()
    user = browser.find_elements("css selector", ".msg.user .body")[-1]
    assert user.find_element("tag name", "strong").text == "hello"  # Markdown rendered, text escaped
    assert user.find_element("tag name", "code").text == "code"
    before = metric(server, "tokenmill:generation_tokens_total")

    # A long reply: text appears while the request runs, then Stop aborts it.
    chat_settings(browser, 3000, '{"ignore_eos": true}')
    send_chat(browser, "Tell me a long story")
    wait_for(browser, lambda d: len(d.find_elements("css selector", ".msg.assistant")) == 2
             and d.find_elements("css selector", ".msg.assistant")[-1].find_element("css selector", ".body").text,
             "streamed text")
    reply = browser.find_elements("css selector", ".msg.assistant")[-1]
    assert reply.get_attribute("data-done") is None  # still streaming when the text showed
    shoot(browser, shots, "chat")
    browser.find_element("id", "chat-stop").click()
    wait_for(browser, lambda d: reply.get_attribute("data-done") == "1", "stopped")
    assert "stopped" in reply.find_element("css selector", ".stats").text
    wait_running_zero(server)
    generated = metric(server, "tokenmill:generation_tokens_total") - before
    assert 0 < generated < 3000, generated
    assert not browser.find_element("id", "chat-error").is_displayed()
    export = json.loads(downloaded(browser, tmp_path_factory.mktemp("chat-export"), "chat-export",
                                   "tokenmill-chat.json"))
    assert export["model"] == "tiny" and [m["role"] for m in export["messages"]] == ["user", "assistant"] * 2
    assert export["messages"][1]["stats"]["completion_tokens"] == 24
    assert export["messages"][3]["stats"]["finish_reason"] == "stopped"
    check_clean(browser)


def test_chat_shows_server_errors(server, browser):
    open_page(browser, server, "chat", "sk-a")
    wait_for(browser, lambda d: d.execute_script("return document.getElementById('chat-model').value") == "tiny",
             "models listed")
    chat_settings(browser, 8, '{"temperature": -3}')
    send_chat(browser, "hi")
    error = wait_for(browser, lambda d: d.find_element("id", "chat-error").is_displayed()
                     and d.find_element("id", "chat-error"), "error shown")
    assert error.text.startswith("400") and "temperature" in error.text, error.text
    check_clean(browser, allowed_statuses=(400,))


# A canned stream (what a reasoning model with tools would send), answered by a stand-in for fetch inside the page:
# the embedded model emits neither reasoning nor tool calls on demand.
CANNED = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "First think <b>hard</b>."}}]},
    {"choices": [{"index": 0, "delta": {"content": "Here: <img src=x onerror=\"window.pwned=1\">\n\n```python\n"
                                                   "print('<hi>')\n```\n- one\n- **two**"}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                        "function": {"name": "get_weather", "arguments": "{\"city\""}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": \"Paris\"}"}}]},
                  "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
]
FAKE_FETCH = """
const events = arguments[0];
const real = window.fetch;
window.fetch = (url, opts) => {
  if (String(url) !== "/v1/chat/completions") return real(url, opts);
  const text = events.map((e) => "data: " + JSON.stringify(e) + "\\n\\n").join("") + "data: [DONE]\\n\\n";
  return Promise.resolve(new Response(text, {status: 200, headers: {"Content-Type": "text/event-stream"}}));
};
"""


def test_chat_renders_reasoning_tool_calls_and_markdown_safely(server, browser):
    open_page(browser, server, "chat", "sk-a")
    wait_for(browser, lambda d: d.execute_script("return document.getElementById('chat-model').value") == "tiny",
             "models listed")
    browser.find_element("id", "chat-clear").click()
    browser.execute_script(FAKE_FETCH, CANNED)
    send_chat(browser, "weather?")
    reply = wait_for(browser, lambda d: d.find_elements("css selector", ".msg.assistant[data-done='1']"), "reply")[-1]
    reasoning = reply.find_element("css selector", "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    assert "First think <b>hard</b>." == reasoning.find_element("tag name", "pre").get_attribute("textContent")
    body = reply.find_element("css selector", ".body")
    assert not body.find_elements("tag name", "img") and not browser.execute_script("return window.pwned")
    assert "<img src=x" in body.text  # shown as text, never run
    code = body.find_element("css selector", "pre code.language-python")
    assert code.get_attribute("textContent") == "print('<hi>')"
    assert [li.text for li in body.find_elements("css selector", "ul li")] == ["one", "two"]
    call = reply.find_element("css selector", ".tool-call")
    assert "get_weather" in call.text and '{"city": "Paris"}' in call.text
    assert "9 tokens" in reply.find_element("css selector", ".stats").text
    assert "tool_calls" in reply.find_element("css selector", ".stats").text
    check_clean(browser)


def load(server, stop: threading.Event, key: str = "sk-b") -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
        while not stop.is_set():
            with client.stream("POST", server.url("/v1/completions"), json=body) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    pass


def test_live_charts_update_while_a_load_runs(server, browser, shots):
    open_page(browser, server, "live", ADMIN)
    browser.find_element("css selector", "#live-interval option[value='1000']").click()
    stop = threading.Event()
    workers = [threading.Thread(target=load, args=(server, stop), daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        now = wait_for(browser, lambda d: float(d.find_element("id", "live-now").get_attribute("data-out") or 0) > 0
                       and float(d.find_element("id", "live-now").get_attribute("data-running") or 0) > 0
                       and d.find_element("id", "live-now"), "generated tokens/s and running requests above 0")
        assert "generated tokens/s" in now.text
        wait_for(browser, lambda d: int(d.find_element("id", "chart-roofline").get_attribute("data-points") or 0) >= 2,
                 "roofline bars over two intervals")
        points = int(browser.find_element("id", "chart-tokens").get_attribute("data-points"))
        wait_for(browser, lambda d: int(d.find_element("id", "chart-tokens").get_attribute("data-points")) > points,
                 "the tokens chart grew")
        peaks = browser.find_element("id", "live-peaks").text
        assert "Measured peaks" in peaks and "GB/s" in peaks and "bound" in peaks, peaks
        shoot(browser, shots, "live")
    finally:
        stop.set()
        for w in workers:
            w.join(WAIT_S)
    check_clean(browser)
    # A tenant's key may not read the server's internals: the page says which key it needs.
    open_page(browser, server, "live", "sk-a")
    note = wait_for(browser, lambda d: d.find_element("id", "live-note").is_displayed()
                    and d.find_element("id", "live-note"), "note")
    assert "needs the internal or admin key" in note.text
    check_clean(browser, allowed_statuses=(403,))


def test_the_pages_metrics_parser_agrees_with_prometheus(server, browser):
    """prom.js against prometheus_client's parser on the server's own /metrics, and its quantile against a
    hand-computed one (PromQL's interpolation within a bucket)."""
    from prometheus_client.parser import text_string_to_metric_families

    open_page(browser, server, "bench", ADMIN)
    text = httpx.get(server.url("/metrics"), headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
    expected: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            expected[sample.name] = expected.get(sample.name, 0.0) + sample.value
    got = browser.execute_async_script("""
        const [text, done] = arguments;
        import("/ui/prom.js").then((p) => {
          const m = p.parseMetrics(text);
          const totals = {};
          for (const name of Object.keys(m)) totals[name] = p.total(m, name);
          const older = [[0.1, 2], [0.5, 4], [Infinity, 4]], newer = [[0.1, 2], [0.5, 12], [Infinity, 14]];
          done({totals, q50: p.quantile(0.5, older, newer), q99: p.quantile(0.99, older, newer),
                none: p.quantile(0.5, newer, newer)});
        });""", text)
    assert got["totals"].keys() == expected.keys()
    for name, value in expected.items():
        assert got["totals"][name] == pytest.approx(value), name
    # 10 new observations: none <= 0.1, 8 in (0.1, 0.5], 2 above. The 5th lies 5/8 into (0.1, 0.5].
    assert got["q50"] == pytest.approx(0.1 + 0.4 * 5 / 8)
    assert got["q99"] == pytest.approx(0.5)  # in the +Inf bucket: its lower bound, as PromQL answers
    assert got["none"] is None
    check_clean(browser)


def usage_rows(driver) -> set[str]:
    table = wait_for(driver, lambda d: d.find_element("id", "usage-table").get_attribute("data-loaded") == "1"
                     and d.find_element("id", "usage-table"), "usage table")
    return {cell.text for cell in table.find_elements("css selector", "td:first-child")}


def test_usage_admin_sees_every_tenant_a_tenant_itself(server, browser, shots, tmp_path_factory):
    for key in ("sk-a", "sk-b"):
        r = httpx.post(server.url("/v1/completions"), headers={"Authorization": f"Bearer {key}"},
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    open_page(browser, server, "usage", ADMIN)
    browser.find_element("id", "usage-load").click()
    assert {"team-a", "team-b"} <= usage_rows(browser)
    limits = wait_for(browser, lambda d: d.find_elements("css selector", "#limits-table td"), "limits")
    text = browser.find_element("id", "limits-table").text
    assert "team-b" in text and "concurrent 4" in text and "requests_per_minute 600" in text, text
    assert limits
    shoot(browser, shots, "usage")
    folder = tmp_path_factory.mktemp("usage-csv")
    day = browser.find_element("id", "usage-from").get_attribute("value")
    to = browser.find_element("id", "usage-to").get_attribute("value")
    csv = downloaded(browser, folder, "usage-csv", f"tokenmill-usage-{day}-{to}.csv")
    served = httpx.get(server.url("/v1/usage"), headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10,
                       params={"from": day, "to": to, "group_by": "tenant,model", "format": "csv"}).text
    assert csv.splitlines()[0] == served.splitlines()[0] and "team-b" in csv  # the server's own CSV
    check_clean(browser)

    open_page(browser, server, "usage", "sk-a")
    browser.find_element("id", "usage-load").click()
    wait_for(browser, lambda d: d.find_element("id", "limits-note").is_displayed(), "limits note")
    assert usage_rows(browser) == {"team-a"}
    assert "team-b" not in browser.find_element("tag name", "body").text
    assert "admin key only" in browser.find_element("id", "limits-note").text
    check_clean(browser, allowed_statuses=(403,))


def test_bench_page_renders_a_saved_result(server, browser, shots, tmp_path_factory):
    result = REPO / "docs" / "bench_results" / "random-c1.json"
    expected = json.loads(result.read_text())
    open_page(browser, server, "bench", ADMIN)
    browser.find_element("id", "bench-file").send_keys(str(result))
    table = wait_for(browser, lambda d: d.find_elements("id", "bench-summary") and d.find_element("id", "bench-summary"),
                     "summary table")
    assert f"Completed\n{expected['summary']['completed']}" in table.text.replace(" ", "\n"), table.text
    canvases = browser.find_elements("css selector", "#bench-report canvas")
    assert len(canvases) == 5
    ok = [r for r in expected["requests"] if r["success"]]
    assert int(canvases[0].get_attribute("data-points")) == len(ok)  # the TTFT histogram counts every request
    shoot(browser, shots, "bench")
    # A result with an error whose message carries HTML: shown as text. A file that is no result: its reason.
    hostile = dict(expected, summary={**expected["summary"], "errors": {
        "total": 1, "by_type": {"http_500": 1},
        "examples": [{"index": 3, "type": "http_500", "status": 500, "message": "<img src=x onerror=window.pwned=1>"}]}})
    folder = tmp_path_factory.mktemp("bench-files")
    (folder / "hostile.json").write_text(json.dumps(hostile))
    (folder / "other.json").write_text('{"not": "a result"}')
    field = browser.find_element("id", "bench-file")
    field.send_keys(str(folder / "hostile.json"))
    wait_for(browser, lambda d: "onerror" in d.find_element("id", "bench-report").text, "the error example")
    assert not browser.find_elements("css selector", "#bench-report img")
    assert not browser.execute_script("return window.pwned")
    field.send_keys(str(folder / "other.json"))
    error = wait_for(browser, lambda d: d.find_element("id", "bench-error").is_displayed()
                     and d.find_element("id", "bench-error"), "not a result")
    assert error.text == "other.json: not a tokenmill bench result (no 'summary')"
    check_clean(browser)

