"""The chat page at `/`, driven in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, through selenium) against a real server on a tiny model pair whose draft the
target accepts only part of the time: a prompt typed and sent with the keyboard streams the
API's greedy text as colored token spans, the statistics and the per-round chart fill in, and a
server-side error or a lost server shows as a readable message.

Screenshots are kept under pytest's tmp dir, and copied to $SPECSERVE_ARTIFACTS when it is set.
The last test stops the server, so it must stay last.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.server.conftest import KEY, NAME
from tests.server.draft_pair import rounds_of, start_pair_server

ORIGINS = {"accepted", "recovered", "bonus", "plain"}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync"]
SYSTEM = "You answer in one line."
PROMPT = "Rename the variable x to count in: x = x + 1"
MAX_TOKENS = 120  # long enough that the chart is seen filling in while the answer streams
WAIT_S = 30


def executable(*names: str) -> str:
    for name in names:
        path = shutil.which(name) or (f"/usr/lib/chromium/{name}" if os.path.exists(
            f"/usr/lib/chromium/{name}") else None)
        if path:
            return path
    raise RuntimeError(f"none of {names} found: install Debian's chromium and chromium-driver "
                       "(apt-get install -y chromium chromium-driver)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_pair_server(tmp_path_factory.mktemp("page"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = executable("chromium", "chromium-browser")
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
                                  "--window-size=1280,1000"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable("chromedriver")), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("screenshots")
    saved: list[Path] = []

    def save(driver, name: str) -> Path:
        path = folder / f"{name}.png"
        assert driver.save_screenshot(str(path)), "the screenshot failed"
        saved.append(path)
        target = os.environ.get("SPECSERVE_ARTIFACTS")
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(target) / path.name)
        return path

    return save


# ----------------------------------------------------------------------------- helpers
def open_page(browser, server) -> None:
    browser.get(f"{server.base_url}/")
    assert browser.switch_to.active_element.get_attribute("id") == "message"  # ready to type
    key = browser.find_element(By.ID, "api-key")
    key.send_keys(KEY, Keys.TAB)  # a 'change': the page asks /v1/models again, with the key
    wait(browser, lambda d: d.find_element(By.ID, "model-name").text == NAME)
    assert browser.find_element(By.ID, "error").text == ""


def wait(browser, condition, timeout: float = WAIT_S):
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(condition)


def fill(browser, element_id: str, value: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.DELETE)
    if value:
        field.send_keys(value)


def last_answer_state(browser) -> str | None:
    return browser.execute_script(
        "const m = [...document.querySelectorAll('.msg.assistant')].pop(); return m ? m.dataset.state : null")


def send_and_wait(browser, text: str, ctrl_enter_in: str | None = None) -> str:
    """Types `text` and sends it with Enter, or with Ctrl+Enter from the field `ctrl_enter_in`;
    returns the answer's final state."""
    before = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    message = browser.find_element(By.ID, "message")
    message.send_keys(text)
    if ctrl_enter_in is None:
        message.send_keys(Keys.ENTER)
    else:
        browser.find_element(By.ID, ctrl_enter_in).send_keys(Keys.CONTROL, Keys.ENTER)
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == before + 1)
    wait(browser, lambda d: last_answer_state(d) not in (None, "streaming"))
    return last_answer_state(browser)


def api_greedy(server, speculative) -> dict:
    body = {"model": NAME, "messages": [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": PROMPT}],
            "temperature": 0, "max_tokens": MAX_TOKENS, "speculative": speculative,
            "return_token_origins": True}
    with server.client() as c:
        resp = c.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stat(browser, key: str) -> str:
    cells = browser.find_elements(By.CSS_SELECTOR, f".msg.assistant dd[data-stat='{key}']")
    return cells[-1].text


# ----------------------------------------------------------------------------- tests
def test_the_page_and_its_assets_are_served_from_the_package_without_outside_urls(server):
    page = httpx.get(f"{server.base_url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    here = Path(__file__).resolve().parents[2] / "specserve" / "server" / "static"
    for name in ("index.html", "app.js", "markdown.js", "style.css"):
        served = page if name == "index.html" else httpx.get(f"{server.base_url}/static/{name}", timeout=10)
        assert served.status_code == 200 and served.text == (here / name).read_text()
        # the only absolute URL is the SVG namespace, which is a name, never fetched
        assert set(re.findall(r"https?://[^\s\"'`)]+", served.text)) <= {"http://www.w3.org/2000/svg"}
    assert "/" not in httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["paths"]


def test_a_typed_prompt_streams_the_apis_greedy_text_in_colored_spans_with_statistics(
        server, browser, shots):
    expected = api_greedy(server, {"num_speculative_tokens": 3})
    open_page(browser, server)
    fill(browser, "system", SYSTEM)
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", str(MAX_TOKENS))
    Select(browser.find_element(By.ID, "spec-mode")).select_by_value("fixed")
    fill(browser, "spec-k", "3")
    # record what the chart shows while the answer is still streaming
    browser.execute_script("""
        window.__seen = [];
        new MutationObserver(() => {
          const m = [...document.querySelectorAll('.msg.assistant')].pop();
          const svg = m && m.querySelector('svg');
          if (svg) window.__seen.push([m.dataset.state, Number(svg.dataset.rounds || 0),
                                       m.querySelectorAll('.answer .tok').length]);
        }).observe(document.getElementById('log'), {subtree: true, childList: true, attributes: true});
    """)
    assert send_and_wait(browser, PROMPT) == "done"

    answer = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .answer")
    text = browser.execute_script("return arguments[0].textContent", answer)
    assert text == expected["choices"][0]["message"]["content"]
    spans = browser.execute_script(
        "return [...arguments[0].querySelectorAll('span.tok')].map(s => [s.className, s.dataset.origin])",
        answer)
    assert spans and all(set(cls.split()) - {"tok", "multi"} <= ORIGINS for cls, _ in spans)
    origins = [o for _, data in spans for o in data.split()]
    assert origins == expected["choices"][0]["origins"]  # one origin per token, in order
    assert {"accepted", "recovered", "bonus"} <= {cls.split()[1] for cls, _ in spans}

    stats = expected["speculative_stats"]
    assert re.fullmatch(r"\d+ ms", stat(browser, "ttft"))
    assert float(stat(browser, "tps")) > 0
    assert stat(browser, "tokens") == str(expected["usage"]["completion_tokens"])
    assert stat(browser, "acceptance") == f"{100 * stats['acceptance_rate']:.1f} %"
    assert stat(browser, "mal") == f"{stats['mean_acceptance_length']:.2f}"
    assert stat(browser, "meank") == f"{stats['drafted'] / stats['rounds']:.2f}"
    svg = browser.find_element(By.CSS_SELECTOR, ".msg.assistant svg")
    assert int(svg.get_attribute("data-rounds")) == stats["rounds"] == len(rounds_of(origins))
    bars = browser.execute_script("return arguments[0].querySelectorAll('rect').length", svg)
    assert bars >= stats["rounds"]  # one or two rects (accepted, rejected) per round
    streaming = [s for s in browser.execute_script("return window.__seen") if s[0] == "streaming"]
    assert any(0 < rounds < stats["rounds"] for _, rounds, _ in streaming), streaming  # fills in
    shots(browser, "page-tiny-model")


def test_a_server_side_error_is_shown_as_a_readable_message(server, browser, shots):
    open_page(browser, server)
    fill(browser, "max-tokens", "100000")  # more than the context holds: a 400 from the server
    assert send_and_wait(browser, "hello") == "error"
    message = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .msg-error")[-1]
    assert message.is_displayed() and message.get_attribute("role") == "alert"
    assert "HTTP 400" in message.text and "max_tokens" in message.text and "context" in message.text
    assert browser.find_element(By.ID, "message").is_enabled()
    shots(browser, "page-error")
    # the next good request goes through, sent with Ctrl+Enter from a settings field
    fill(browser, "max-tokens", "8")
    assert send_and_wait(browser, "again", ctrl_enter_in="temperature") == "done"


def test_keyboard_labels_and_a_narrow_window(server, browser, shots):
    browser.set_window_size(390, 844)
    try:
        open_page(browser, server)
        unlabeled = browser.execute_script("""
            return [...document.querySelectorAll('input, select, textarea')]
              .filter(e => !e.labels || e.labels.length === 0).map(e => e.id)""")
        assert unlabeled == []
        browser.find_element(By.ID, "message").click()
        order = []
        for _ in range(3):
            browser.switch_to.active_element.send_keys(Keys.TAB)
            order.append(browser.switch_to.active_element.get_attribute("id"))
        assert order == ["send", "clear", "system"]  # Stop is disabled while idle
        fill(browser, "max-tokens", "24")
        fill(browser, "temperature", "0")
        assert send_and_wait(browser, "narrow") == "done"
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0
        shots(browser, "page-narrow")
    finally:
        browser.set_window_size(1280, 1000)


# what a model's Markdown answer streams as: token texts and their origins
MARKDOWN_TOKENS = [("Here", "plain"), (" is", "accepted"), (" **the", "accepted"), (" fix**", "bonus"),
                   (":\n\n", "recovered"), ("```", "accepted"), ("py", "accepted"), ("thon\n", "bonus"),
                   ("count", "plain"), (" = ", "accepted"), ("count + 1\n", "recovered"),
                   ("```\n", "bonus"), ("\n- use", "plain"), (" `count`", "accepted"),
                   ("\n- done", "bonus"), ("", "plain")]


def test_markdown_renders_a_fenced_code_block_as_code_with_colored_tokens_inside(server, browser, shots):
    open_page(browser, server)
    got = browser.execute_script("""
        const segments = arguments[0].map(([text, origin]) => ({text, origin, tokens: origin,
                                                                 title: origin, multi: false}));
        const answer = document.createElement('div');
        answer.className = 'answer';
        document.getElementById('log').append(answer);
        window.SpecserveMarkdown.render(answer, segments);
        const code = answer.querySelector('pre code');
        const shown = (n) => n.getClientRects().length > 0;
        return {
          text: answer.textContent,
          code: code && code.innerText, lang: code && code.dataset.lang,
          codeColors: code ? [...code.querySelectorAll('span.tok, span.tok-cont')]
            .filter(shown).map((s) => [s.textContent, s.classList[1]]) : [],
          codeFont: code && getComputedStyle(code).fontFamily,
          origins: [...answer.querySelectorAll('span.tok')].map((s) => s.dataset.origin),
          strong: [...answer.querySelectorAll('p strong')].map((s) => s.textContent),
          items: [...answer.querySelectorAll('ul > li')].map((li) => li.innerText),
          inlineCode: [...answer.querySelectorAll('li code')].map((c) => c.textContent),
          hiddenShown: [...answer.querySelectorAll('.md-mark')].some(shown),
        };
    """, MARKDOWN_TOKENS)
    assert got["text"] == "".join(t for t, _ in MARKDOWN_TOKENS)  # nothing lost, nothing added
    assert got["origins"] == [o for _, o in MARKDOWN_TOKENS]  # one colored span per token
    assert got["code"].strip() == "count = count + 1" and got["lang"] == "python"  # fences hidden
    assert got["codeColors"] == [["count", "plain"], [" = ", "accepted"], ["count + 1\n", "recovered"]]
    assert "mono" in got["codeFont"]
    assert got["strong"] == ["the fix"]
    assert got["items"] == ["use count", "done"] and got["inlineCode"] == ["count"]
    assert not got["hiddenShown"]  # fences, list markers, ** and ` are not shown
    shots(browser, "page-markdown")


def test_an_answer_without_drafting_says_so_in_words(server, browser):
    open_page(browser, server)
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "6")
    Select(browser.find_element(By.ID, "spec-mode")).select_by_value("off")
    assert send_and_wait(browser, "plain please") == "done"
    note = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .spec-note")[-1]
    assert note.is_displayed() and note.text.startswith("Drafting was off for this answer")
    # rounds with k = 0 (here: the last token, with no room left for drafts) are counted in words
    for max_tokens in (6, 9):
        open_page(browser, server)  # a new conversation
        fill(browser, "temperature", "0")
        fill(browser, "max-tokens", str(max_tokens))
        Select(browser.find_element(By.ID, "spec-mode")).select_by_value("fixed")
        fill(browser, "spec-k", "3")
        assert send_and_wait(browser, "draft please") == "done"
        with server.client() as c:
            body = c.post("/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": "draft please"}],
                "temperature": 0, "max_tokens": max_tokens, "return_token_origins": True,
                "speculative": {"num_speculative_tokens": 3}}).json()
        rounds = rounds_of(body["choices"][0]["origins"])
        off = sum(r == ["plain"] for r in rounds)
        note = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .spec-note")[-1]
        if off:
            assert note.text.startswith(f"Drafting was off in {off} of {len(rounds)} rounds (k = 0)")
        else:
            assert not note.is_displayed()


def test_a_lost_server_is_shown_as_a_readable_message(server, browser, shots):
    open_page(browser, server)
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "900")
    Select(browser.find_element(By.ID, "spec-mode")).select_by_value("off")  # one token a step
    browser.find_element(By.ID, "message").send_keys("a long answer", Keys.ENTER)
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .answer .tok"))
    assert last_answer_state(browser) == "streaming"
    server.process.kill()  # last test: the module's server dies mid-answer
    wait(browser, lambda d: last_answer_state(d) != "streaming")
    assert last_answer_state(browser) == "error"
    message = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .msg-error")[-1].text
    assert "connection" in message.lower(), message
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .answer .tok")  # text kept
    shots(browser, "page-lost-server")
    # and a request to a server that is gone
    assert send_and_wait(browser, "anyone there?") == "error"
    message = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .msg-error")[-1].text
    assert "Lost the connection to the server" in message
    assert browser.find_element(By.ID, "composer").is_displayed()
