"""The chat page at `/` in a real browser: Debian's chromium driven by Playwright, against a real
server that requires an API key. The page asks for the key (a message without it gets the 401),
streams a reply equal to the API's, stops one mid-answer (the server cancels it), forgets one on New
chat (cancelled too), and JSON mode gives a reply that parses."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.e2e.clients import metric
from tests.e2e.payloads import SCHEMA, valid
from tests.helpers import ServerProcess, tiny_config

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: apt-get install chromium (README)")
KEY = "page-test-key"
FINISHED = "llm_serving_requests_finished_total"
CANCELLED = FINISHED + '{reason="cancelled"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    srv = ServerProcess(tiny_config(tmp_path_factory.mktemp("page"), tiny_model_dir, num_blocks=512, block_size=4,
                                    decode_seq_length=1024, max_generate_length=1024), "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, server, key: str | None = KEY):
    page = browser.new_page(bypass_csp=True)  # the page's own policy forbids the eval waits are made of
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#key-box")).to_be_visible()  # the page holds no key: it asks
    if key:
        page.fill("#key", key)
        page.click("#key-box button")
        sync_api.expect(page.locator("#model")).to_have_text("tiny")
    return page


def _open_settings(page) -> None:
    if page.locator("#settings").get_attribute("open") is None:
        page.click("#settings summary")


def _send(page, text: str, **settings: str) -> None:
    if settings:
        _open_settings(page)
    for field, value in settings.items():
        page.fill(f"#{field}", value)
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_the_page_loads_without_a_failed_request(browser, server):
    page = browser.new_page(bypass_csp=True)
    failed: list[str] = []
    page.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
    page.goto(server.url + "/")
    page.wait_for_load_state("networkidle")
    assert [u for u in failed if not u.endswith("/v1/models")] == []  # no key yet: the models' 401 is the ask
    icon = page.locator("link[rel=icon]").get_attribute("href")  # browsers ask for one (a 404 on every load)
    assert httpx.get(server.url + icon, timeout=10).headers["content-type"] == "image/svg+xml"
    page.close()


def test_without_the_key_the_page_asks_for_it_and_shows_the_401(browser, server):
    page = _open(browser, server, key=None)
    sync_api.expect(page.locator("#key-status")).to_contain_text("needs an API key")
    _send(page, "hello")
    sync_api.expect(page.locator(".msg.assistant.error")).to_contain_text("401")
    page.close()


def test_a_reply_streams_in_and_equals_the_api_s(browser, server):
    page = _open(browser, server)
    _send(page, "hello", temperature="0", max_tokens="24")
    sync_api.expect(page.locator(".stats")).to_contain_text("TTFT")  # written when the stream has ended
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 24, "temperature": 0}
    want = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60).json()["choices"][0]["message"]["content"]
    assert page.locator(".msg.assistant").inner_text() == want
    page.close()


def _cancel_mid_answer(browser, server, button: str, on_request=None):
    """A page whose long answer `button` cancelled at the server while text streamed in. The answer can
    end on its own before the agents pause (a loaded machine may poll the page only after the whole
    answer; a step already taken may hold its last token): the server's finished count says which
    happened, and such a round is sent again on a fresh page. Returns the page."""
    for _ in range(5):
        page = _open(browser, server)
        if on_request:
            page.on("request", on_request)
        finished, cancelled = metric(server.url, FINISHED), metric(server.url, CANCELLED)
        _send(page, "tell me everything", temperature="0", max_tokens="950")
        # text has arrived (a cancel below then proves it streamed, not all at the end)
        page.wait_for_function("document.querySelector('.msg.assistant')?.textContent.length > 0")
        with server.agents_paused():  # no step ends during the click; a disabled button ignores it
            page.evaluate(f"document.getElementById('{button}').click()")
        page.wait_for_function(f"fetch('/metrics').then(r => r.text()).then(t => t.split('\\n')"
                               f".filter(l => l.startsWith('{FINISHED}')).reduce((n, l) => n + +l.split(' ').pop(), 0)"
                               f" > {finished})")
        if metric(server.url, CANCELLED) == cancelled + 1:
            return page
        page.close()
    raise AssertionError("every answer ended before the click")


def test_stop_mid_answer_cancels_it_on_the_server(browser, server):
    page = _cancel_mid_answer(browser, server, "stop")
    sync_api.expect(page.locator(".stats")).to_contain_text("stopped")
    page.close()


def test_new_chat_mid_answer_cancels_it_and_forgets_it(browser, server):
    """New chat while a reply streams: the server cancels it, Send works at once, the new chat shows
    nothing of it, and the next request carries the new turn alone."""
    bodies: list[dict] = []
    page = _cancel_mid_answer(browser, server, "clear", lambda r: bodies.append(json.loads(r.post_data))
                              if r.url.endswith("/v1/chat/completions") else None)
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
    assert page.locator("#transcript > *").count() == 0  # nothing of the old answer came in after the click
    _send(page, "second", temperature="0", max_tokens="4")
    sync_api.expect(page.locator(".stats")).to_contain_text("TTFT")
    assert bodies[-1]["messages"] == [{"role": "user", "content": "second"}]
    assert page.locator(".stats").count() == 1 and page.locator(".msg").count() == 2
    page.close()


def test_json_mode_gives_a_reply_that_parses(browser, server):
    page = _open(browser, server)
    _open_settings(page)
    page.check("#json_mode")
    page.fill("#schema", json.dumps(SCHEMA))
    _send(page, "a colour please", max_tokens="300")
    sync_api.expect(page.locator(".stats")).to_contain_text("TTFT")
    assert valid(json.loads(page.locator(".msg.assistant").inner_text()))
    page.close()
