"""The web page at `/` in headless Chromium, and `/status`, the JSON it reads.

One server for the module: a tiny scripted hybrid model (`kvq_testing.scripted`)
whose greedy reply is Markdown with raw HTML in it, repeated until max_tokens, behind an API key, started with
its warm-up held at a gate so that the page is also seen while warming up.
One browser session for the module. Without chromium and chromedriver the
browser tests skip with that reason; CI installs them (.ci/run) and sets
KVQ_REQUIRE_BROWSER=1, which turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter

import httpx
import pytest
from kvq_testing.scripted import Reply, save_scripted_model
from kvq_testing.server import ServerProcess

from mlx_kvq.defaults import DEFAULT_KV_CONFIG

MODEL_ID = "kvq-web-test"
API_KEY = "sk-web-test"
# One token each; the reply is these, in order, until max_tokens.
REPLY = ["Hello", " from", " **the", " cache**", ":", " <script>", "alert(1)", "</script>",
         " <img", " src=x", " onerror=alert(2)>", "\n\n<script>", "document.title='pwned'",
         "</script>\n\n"]  # fmt: skip
RAW_HTML = ("<script>alert(1)</script>", "<img src=x onerror=alert(2)>",
            "<script>document.title='pwned'</script>")  # fmt: skip
WAIT_S = 90.0
CANCELLED = 'mlx_kvq_requests_total{status="cancelled"}'

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# Without the networking flags Chromium's background services make it flaky
# on a machine with no network; a fresh profile keeps runs independent.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--window-size=1400,900")  # fmt: skip


def browser_missing() -> str | None:
    missing = [n for n, p in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not p]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not installed (Debian: apt-get install chromium chromium-driver)"
    )


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    # The last piece leads back to the first (20.5) rather than to EOS (20): a loop.
    reply = Reply(REPLY, extra={(REPLY[-1], REPLY[0]): 20.5})
    path = save_scripted_model(root / "scripted", {}, reply, template="plain", arch="hybrid")
    gate = root / "gate"
    args = ("--served-model-name", MODEL_ID, "--warmup-gate", str(gate),
            "--max-tokens", str(len(REPLY)))  # fmt: skip
    with ServerProcess(path, *args, api_key=API_KEY) as s:
        s.wait_for("/live", 200)
        yield s, gate


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    reason = browser_missing()
    if reason:
        if os.environ.get("KVQ_REQUIRE_BROWSER"):
            pytest.fail(f"KVQ_REQUIRE_BROWSER is set but {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def warmup_view(gated, browser):
    """What the page shows while the warm-up is held, then once it is released."""
    server, gate = gated
    browser.get(server.url + "/")
    wait(browser, lambda d: state(d) == "warming_up", "the page to say warming up")
    view = {
        "badge": text(browser, "state"),
        "notice": text(browser, "notice"),
        "model": text(browser, "model"),
        "errors": console_errors(browser),
    }
    gate.touch()
    server.wait_ready()
    wait(browser, lambda d: state(d) == "ready", "the page to say ready")
    view["notice_after"] = browser.find_element("id", "notice").is_displayed()
    view["errors"] += console_errors(browser)
    return view


@pytest.fixture(scope="module")
def server(gated, request):
    s, gate = gated
    if browser_missing() is None:
        request.getfixturevalue("warmup_view")  # sees the gated phase first
    gate.touch()
    s.wait_ready()
    return s


# ---------------------------------------------------------------- helpers
def wait(driver, condition, what, timeout=WAIT_S):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    waiting = WebDriverWait(driver, timeout, poll_frequency=0.05,
                            ignored_exceptions=(StaleElementReferenceException,))  # fmt: skip
    return waiting.until(condition, message=what)


def text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def state(driver) -> str | None:
    return driver.find_element("id", "state").get_attribute("data-state")


def console_errors(driver) -> list[str]:
    """Console errors since the last call (the log is drained by reading it)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, server, key: str | None = None) -> None:
    """The page with an empty browser store (and `key` stored), its panel filled."""
    driver.get(server.url + "/")
    driver.execute_script("localStorage.clear()")
    if key:
        driver.execute_script("localStorage.setItem('mlx-kvq.api-key', arguments[0])", key)
    driver.get(server.url + "/")
    wait(driver, lambda d: text(d, "model") == MODEL_ID and state(d) == "ready", "the panel")
    wait(driver, lambda d: d.find_elements("css selector", "#plan-table tbody tr"), "plan rows")


def panel_requests(driver) -> dict[str, int]:
    """The panel's request counters ("3 ok, 1 cancelled, 2 unauthorized"; zeros left out)."""
    words = text(driver, "stat-requests")
    return Counter({k: int(n) for n, k in re.findall(r"(\d+) (\w+)", words)})


def panel_prompt_cache_entries(driver) -> int:
    return int(text(driver, "stat-prompt-cache").split("/")[0])


def send(driver, message: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "input")
    lines = message.split("\n")
    for i, line in enumerate(lines):
        box.send_keys(line)
        if i < len(lines) - 1:
            box.send_keys(Keys.SHIFT, Keys.ENTER)
    box.send_keys(Keys.ENTER)


def replies(driver):
    return driver.find_elements("css selector", "#messages li.assistant")


def finished_reply(driver, count: int):
    """The `count`-th assistant message once its stream has ended."""

    def done(d):
        found = replies(d)
        if len(found) < count or found[count - 1].get_attribute("data-done") != "true":
            return False
        return found[count - 1]

    return wait(driver, done, f"assistant message {count} to finish")


def key_dialog_asks(driver, words: str) -> None:
    def asking(d):
        dialog = d.find_element("id", "key-dialog")
        return dialog.get_attribute("open") is not None and words in text(d, "key-message")

    wait(driver, asking, f"the API-key dialog to say {words!r}")


def enter_key(driver, key: str) -> None:
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element("id", "key-input")
    field.send_keys(key, Keys.ENTER)


def status(server) -> dict:
    r = httpx.get(server.url + "/status", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_status(server, predicate, what):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        body = status(server)
        if predicate(body):
            return body
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {status(server)}")


# ---------------------------------------------------------------- /status and files
def test_a_package_without_the_page_refuses_to_start(monkeypatch):
    from mlx_kvq.server import web

    assert set(web.REQUIRED_FILES) <= set(web.load_assets())
    monkeypatch.setattr(web, "STATIC_DIR", "no-such-folder")
    with pytest.raises(FileNotFoundError, match="index.html.*reinstall mlx-kvq"):
        web.load_assets()


def test_status_is_open_and_describes_plan_and_engine(server):
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    body = wait_status(server, lambda b: b["queue_depth"] == 0 and b["batch_size"] == 0, "idle")
    assert body["model"] == MODEL_ID
    assert (body["status"], body["reason"]) == ("ready", None)
    assert body["api_key_required"] is True
    assert body["blas"]["fast"] is True and "openblas" in body["blas"]["library"].lower()
    budget = body["budget"]  # the default KV budget, derived from this machine
    assert set(budget) == {
        "bytes", "reserved", "live", "prompt_cache", "admitted", "waiting", "capacity",
        "preempted", "preemptions", "resumptions",
    }  # fmt: skip
    assert budget["preempted"] == budget["preemptions"] == budget["resumptions"] == 0
    assert budget["bytes"] > 0 and budget["reserved"] == budget["live"] == 0
    assert budget["admitted"] == budget["waiting"] == 0
    assert budget["capacity"].startswith("KV budget ")
    assert body["defaults"]["max_tokens"] == len(REPLY)

    # Every slot as the planner sees the model (the scripted hybrid: sliding, full, sliding).
    from mlx_kvq.plan import plan_kv

    want = plan_kv(server.model, DEFAULT_KV_CONFIG).layers
    plan = body["plan"]
    assert plan["kv_config"]["window_bits"] == DEFAULT_KV_CONFIG.window_bits
    n = len(want)
    assert len(plan["slots"]) == plan["kv_layers"] == n == 3
    assert [s["kind"] for s in plan["slots"]] == ["sliding", "full", "sliding"]
    for i, (slot, layer) in enumerate(zip(plan["slots"], want, strict=True)):
        assert slot["slot"] == i
        assert (slot["kind"], slot["window"]) == (layer.kind, layer.window)
        key, value = DEFAULT_KV_CONFIG.specs(bounded=layer.window is not None)
        assert (slot["key_bits"], slot["value_bits"]) == (key.bits, value.bits)
        assert slot["rotation"] == key.rotation
        assert slot["quantized"] is True and slot["kv"] is True
        per_token = layer.kv_heads * (
            layer.key_dim * key.bytes_per_element() + layer.value_dim * value.bytes_per_element()
        )
        assert slot["bytes_per_token"] == pytest.approx(per_token)
    assert plan["bytes_per_token"] == round(sum(s["bytes_per_token"] for s in plan["slots"]))
    assert plan["quantized_layers"] == n
    assert body["kv"] == {"bytes": 0, "by_kind": {"full": 0, "sliding": 0}, "layers": n,
                          "layers_quantized": n}  # fmt: skip
    assert set(body["requests"]) == {"ok", "cancelled", "error", "rejected", "unauthorized"}

    # A request moves the counters; its text never appears in /status.
    marker = "zebra-417-marker"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=WAIT_S, headers=server.headers(),
                   json={"messages": [{"role": "user", "content": marker}]})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "".join(REPLY)
    after = wait_status(server, lambda b: b["requests"]["ok"] == body["requests"]["ok"] + 1, "ok")
    assert after["tokens"]["generation"] == body["tokens"]["generation"] + len(REPLY)
    assert after["prompt_cache"]["entries"] > body["prompt_cache"]["entries"]
    assert after["prompt_cache"]["bytes"] > body["prompt_cache"]["bytes"]
    assert after["prompt_cache"]["misses"] == body["prompt_cache"]["misses"] + 1
    raw = httpx.get(server.url + "/status", timeout=10).text
    for words in (marker, "Hello", "alert", "cache**"):
        assert words not in raw


def test_page_files_are_served_with_a_strict_policy(server):
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    referenced = re.findall(r'(?:src|href)="/static/([^"]+)"', page.text)
    assert {"app.js", "style.css", "favicon.svg"} <= set(referenced)
    for name in [*referenced, "chat.js", "panel.js", "markdown.js", "vendor/marked.esm.js",
                 "vendor/purify.es.mjs", "vendor/marked-LICENSE.txt",
                 "vendor/dompurify-LICENSE-APACHE.txt", "vendor/dompurify-LICENSE-MPL.txt"]:  # fmt: skip
        r = httpx.get(f"{server.url}/static/{name}", timeout=10)
        assert r.status_code == 200 and r.content, name
    assert "javascript" in httpx.get(server.url + "/static/app.js").headers["content-type"]
    icon = httpx.get(server.url + "/favicon.ico", timeout=10)
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    for missing in ("/static/nope.js", "/static/%2e%2e/web.py", "/static/..%2fweb.py"):
        assert httpx.get(server.url + missing, timeout=10).status_code == 404, missing


# ---------------------------------------------------------------- the page
def test_page_says_warming_up_then_ready_without_errors(warmup_view):
    assert warmup_view["badge"] == "warming up"
    assert warmup_view["notice"].startswith("Warming up")
    assert warmup_view["model"] == MODEL_ID
    assert warmup_view["notice_after"] is False
    assert warmup_view["errors"] == []


def test_page_names_the_model_and_shows_every_plan_slot(server, browser):
    open_page(browser, server)
    assert text(browser, "model") == MODEL_ID
    assert browser.title == f"{MODEL_ID} · mlx-kvq"
    slots = status(server)["plan"]["slots"]
    rows = browser.find_elements("css selector", "#plan-table tbody tr")
    assert len(rows) == len(slots)
    for row, slot in zip(rows, slots, strict=True):
        assert row.get_attribute("data-slot") == str(slot["slot"])
        assert row.find_element("css selector", ".kind").text == slot["kind"]
        assert row.find_element("css selector", ".key-bits").text == str(slot["key_bits"])
        assert row.find_element("css selector", ".value-bits").text == str(slot["value_bits"])
        assert row.find_element("css selector", ".storage").text == "quantized"
    assert not browser.find_element("id", "unquantized-alarm").is_displayed()
    kinds = browser.find_elements("css selector", "#kv-kinds .kind-row")
    assert sorted(k.get_attribute("data-kind") for k in kinds) == ["full", "sliding"]
    assert console_errors(browser) == []


def test_chat_asks_for_the_key_streams_and_shows_model_html_as_text(server, browser):
    open_page(browser, server)
    before_requests = panel_requests(browser)
    before_entries = panel_prompt_cache_entries(browser)

    send(browser, "Tell me about\nthe cache")
    # /status says a key is needed: the page asks before sending anything.
    key_dialog_asks(browser, "requires an API key")
    enter_key(browser, "sk-wrong")
    key_dialog_asks(browser, "refused")  # the server answered 401
    enter_key(browser, API_KEY)

    reply = finished_reply(browser, 1)
    user = browser.find_element("css selector", "#messages li.user .content")
    assert user.text == "Tell me about\nthe cache"  # Shift+Enter made a new line
    assert int(reply.get_attribute("data-chunks")) == len(REPLY)  # one SSE delta per token
    content = reply.find_element("css selector", ".content")
    for raw in RAW_HTML:
        assert raw in content.text
    assert content.find_element("css selector", "strong").text == "the cache"  # Markdown
    assert browser.find_elements("css selector", "#messages script, #messages img") == []
    assert browser.title == f"{MODEL_ID} · mlx-kvq"
    meta = reply.find_element("css selector", ".meta").text
    assert meta.startswith(f"{len(REPLY)} tokens") and "finish: length" in meta

    # The KV panel's numbers move with the request.
    wait(browser, lambda d: panel_requests(d)["ok"] == before_requests["ok"] + 1, "ok + 1")
    assert panel_prompt_cache_entries(browser) > before_entries
    assert panel_requests(browser)["unauthorized"] == before_requests["unauthorized"] + 1

    # Kept in this browser only: reloading shows the same conversation.
    assert browser.execute_script("return localStorage.getItem('mlx-kvq.api-key')") == API_KEY
    assert browser.get_cookies() == []
    browser.refresh()
    wait(browser, lambda d: len(replies(d)) == 1, "the stored conversation")
    assert RAW_HTML[0] in replies(browser)[0].find_element("css selector", ".content").text
    errors = console_errors(browser)
    assert len(errors) == 1 and "401" in errors[0], errors  # Chromium logs the refused request

    browser.find_element("id", "new-chat").click()
    assert replies(browser) == []
    stored = browser.execute_script("return localStorage.getItem('mlx-kvq.chat')")
    assert json.loads(stored) == {"messages": []}


ATTACKS = ["[x](javascript:alert(1))", "![x](javascript:alert(1))", "[x](JaVaScRiPt:alert(1))",
           "[x](&#106;avascript:alert(1))", "[x](data:text/html,<script>alert(1)</script>)",
           "<a href=javascript:alert(1)>a</a>", "<svg onload=alert(1)>", "<javascript:alert(1)>",
           "<iframe src=x>", "<details open ontoggle=alert(1)>", "<style>body{display:none}</style>",
           "<scr<script>ipt>alert(1)</script>", "![tracker](https://example.com/t.png)",
           "| <b>x</b> | y |\n|---|---|\n| <img src=x onerror=alert(1)> | z |",
           "- [x] <input type=text autofocus onfocus=alert(1)>"]  # fmt: skip
MARKUP_TAGS = {"a", "p", "br", "hr", "strong", "em", "del", "code", "pre", "blockquote", "ul",
               "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6", "table", "thead", "tbody", "tr",
               "th", "td"}  # fmt: skip


def test_markdown_from_the_model_cannot_become_markup(server, browser):
    from html.parser import HTMLParser

    open_page(browser, server)
    rendered = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import('/static/markdown.js').then((m) => done(arguments[0].map(m.renderMarkdown)));",
        ATTACKS,
    )
    found: list[tuple[str, list]] = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.append((tag, attrs))

    for html in rendered:
        Tags().feed(html)
    assert {tag for tag, _ in found} <= MARKUP_TAGS
    attributes = [(name, value) for _, attrs in found for name, value in attrs]
    assert {name for name, _ in attributes} <= {"href", "target", "rel", "class", "align"}
    assert [v for n, v in attributes if n == "href"] == ["https://example.com/t.png"]
    assert "&lt;img src=x onerror=alert(1)&gt;" in rendered[-2]  # shown, as text
    assert console_errors(browser) == []


SHOWN_TEXT = "return document.querySelector('#messages li.assistant .content').textContent"


def test_stop_button_cancels_the_request(server, browser):
    open_page(browser, server, key=API_KEY)
    cancelled = server.metrics()[CANCELLED]
    tokens = browser.find_element("id", "max-tokens")
    tokens.clear()
    tokens.send_keys("4000")
    send(browser, "Never stop")

    def streaming_with_live_kv(d):
        found = replies(d)
        if not found or "streaming" not in found[0].get_attribute("class"):
            return False
        return int(found[0].get_attribute("data-chunks")) > 2 * len(REPLY) and text(
            d, "kv-total"
        ) not in ("-", "0 B")

    wait(browser, streaming_with_live_kv, "text streaming in while the panel shows live KV")
    shown = len(browser.execute_script(SHOWN_TEXT))
    browser.find_element("id", "stop").click()
    reply = finished_reply(browser, 1)
    assert "stopped" in reply.find_element("css selector", ".meta").text
    assert len(browser.execute_script(SHOWN_TEXT)) >= shown
    assert browser.find_element("id", "send").is_displayed()

    deadline = time.monotonic() + WAIT_S
    while server.metrics()[CANCELLED] < cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics()[CANCELLED] == cancelled + 1
    wait(browser, lambda d: panel_requests(d)["cancelled"] == cancelled + 1, "panel: cancelled")
    wait(browser, lambda d: text(d, "kv-total") == "0 B", "the sequence's KV released")
    assert console_errors(browser) == []


STUB = """
const events = arguments[1];
window.statusPatch = arguments[0];
const realFetch = window.fetch;
window.fetch = async (url, options) => {
  if (String(url).startsWith("/status")) {
    const body = await (await realFetch(url, options)).json();
    Object.assign(body, window.statusPatch.top);
    Object.assign(body.plan.slots[0], window.statusPatch.slot0);
    return new Response(JSON.stringify(body), {headers: {"Content-Type": "application/json"}});
  }
  if (String(url).startsWith("/v1/chat/completions")) {
    const text = events.map((e) => `data: ${JSON.stringify(e)}\\n\\n`).join("") + "data: [DONE]\\n\\n";
    return new Response(text, {headers: {"Content-Type": "text/event-stream"}});
  }
  return realFetch(url, options);
};
"""


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk", "model": MODEL_ID,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip


def test_page_shows_reasoning_tool_calls_budget_and_unquantized_slots(server, browser):
    """The page against shapes this server does not send yet (stubbed in the
    browser): mlx_lm.server's `delta.reasoning`, OpenAI's streamed `tool_calls`,
    the budget object, a slot left unquantized, and a failed engine."""
    open_page(browser, server, key=API_KEY)
    budget = {"bytes": 64 << 20, "reserved": 24 << 20, "live": 8 << 20,
              "prompt_cache": 4 << 20, "admitted": 3, "waiting": 5, "preempted": 2,
              "preemptions": 7, "resumptions": 5,
              "capacity": "KV budget 64 MiB: 9 sequences of 2,048 tokens"}  # fmt: skip
    slot0 = {"quantized": False, "key_bits": None, "value_bits": None, "rotation": "none"}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    events = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "The user wants "}),
        chunk({"reasoning": "*the weather*."}),
        chunk({"content": "Let me check."}),
        chunk({"tool_calls": [{"index": 0, **call}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    }
                ]
            }
        ),  # fmt: skip
        chunk({}, "tool_calls"),
    ]
    browser.execute_script(STUB, {"top": {"budget": budget}, "slot0": slot0}, events)

    wait(browser, lambda d: d.find_element("id", "budget").is_displayed(), "the budget section")
    wait(browser, lambda d: text(d, "budget-bytes") == "64.0 MiB", "the stubbed budget")
    assert text(browser, "budget-use") == "8.00 MiB / 24.0 MiB"
    assert text(browser, "budget-sequences") == "3 admitted, 5 waiting"
    assert text(browser, "budget-preemptions") == "7 times, 5 resumed, 2 waiting to resume"
    assert text(browser, "budget-capacity") == budget["capacity"]
    row = browser.find_element("css selector", "#plan-table tbody tr[data-slot='0']")
    wait(browser, lambda d: "unquantized" in row.get_attribute("class"), "slot 0 marked")
    assert row.find_element("css selector", ".storage").text == "UNQUANTIZED"
    assert row.find_element("css selector", ".key-bits").text == "16"
    alarm = browser.find_element("id", "unquantized-alarm")
    assert alarm.is_displayed() and alarm.text.startswith("1 of 3 KV slots are UNQUANTIZED")

    send(browser, "Weather in Paris?")
    reply = finished_reply(browser, 1)
    reasoning = reply.find_element("css selector", "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    assert reasoning.find_element("css selector", "em").get_attribute("textContent") == (
        "the weather"
    )
    assert reply.find_element("css selector", ".content").text == "Let me check."
    calls = reply.find_elements("css selector", ".tool-call")
    assert [c.find_element("css selector", ".tool-name").text for c in calls] == [
        "tool call: get_weather",
        "tool call: get_time",
    ]
    assert json.loads(calls[0].find_element("css selector", "pre").text) == {"city": "Paris"}
    assert "finish: tool_calls" in reply.find_element("css selector", ".meta").text

    failed = {"status": "failed", "reason": "engine failed: RuntimeError: boom"}
    browser.execute_script("Object.assign(window.statusPatch.top, arguments[0])", failed)
    wait(browser, lambda d: state(d) == "failed", "the failed state")
    notice = browser.find_element("id", "notice")
    assert notice.is_displayed() and failed["reason"] in notice.text
    assert not browser.find_element("id", "send").is_enabled()
    assert console_errors(browser) == []
