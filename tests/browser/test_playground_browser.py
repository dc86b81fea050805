"""The playground page in headless Chromium against a real `pagedserve serve`
(the default model, float32) started with --api-key: the page asks for the
key and shows the server's 401, works once the key is entered, streams the
answer to "What is the capital of France?" at the temperature set on the page,
stops a long reply (the server counts the request as aborted), regenerates,
shows the server's 400 for bad input, fills the /metrics panel, and its
screenshot is not blank."""
from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from serve_helpers import metric_samples, running_server

API_KEY = "playground-test-key"
FINISHED = "pagedserve:request_success_total"  # by finished_reason: "abort" counts the requests aborted


def aborted_requests(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == FINISHED and sample.labels.get("finished_reason") == "abort")


def wait_until(condition, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Eager: the page is under test, not the compiled step (tests/e2e/test_process_split.py).
    with running_server(tmp_path_factory.mktemp("serve"), ["--api-key", API_KEY, "--enable-log-requests",
                                                           "--enforce-eager"]) as srv:
        yield srv


class Page:
    """The playground as a user drives it."""

    def __init__(self, driver):
        self.driver = driver

    def find(self, css: str):
        from selenium.webdriver.common.by import By
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def set_value(self, css: str, value: str) -> None:
        """As typing or dragging does: the value, then an input event."""
        self.js("const e = document.querySelector(arguments[0]); e.value = arguments[1];"
                "e.dispatchEvent(new Event('input', {bubbles: true}));", css, value)

    def replies(self) -> list[dict]:
        return self.js("return [...document.querySelectorAll('.message.assistant')].map(b => ({"
                       "state: b.dataset.state, text: b.querySelector('.content').textContent,"
                       "stats: (b.querySelector('.stats') || {}).textContent || '', ttft: b.dataset.ttftMs,"
                       "tps: b.dataset.tokensPerS, html: b.querySelector('.content').innerHTML}))")

    def ask(self, question: str) -> None:
        from selenium.webdriver.common.keys import Keys
        prompt = self.find("#prompt")
        prompt.send_keys(question)
        prompt.send_keys(Keys.ENTER)

    def record_reply_growth(self) -> None:
        """Keep every text the newest reply shows, to see it arrive in pieces."""
        self.js("window.seen = []; new MutationObserver(() => { const all = document.querySelectorAll("
                "'.message.assistant .content'); const last = all[all.length - 1];"
                "if (last && last.textContent !== window.seen[window.seen.length - 1]) window.seen.push("
                "last.textContent); }).observe(document.getElementById('messages'),"
                "{childList: true, subtree: true, characterData: true});")

    def wait_reply(self, state: str, timeout: float = 60.0) -> dict:
        return wait_until(lambda: (r := self.replies()) and r[-1]["state"] == state and r[-1], timeout,
                          f"a reply in state {state}")


def test_the_playground_in_a_browser(server, browser, tmp_path):
    page = Page(browser)
    browser.get(server.base_url + "/")

    # The API is closed without the key; the page asks for it and shows the server's refusal.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.base_url + "/v1/models", timeout=30)
    assert refused.value.code == 401
    wait_until(lambda: page.find("#key-form").is_displayed(), 30, "the key form")
    assert "HTTP 401" in page.find("#key-reason").text
    page.find("#api-key").send_keys("wrong-key\n")
    wait_until(lambda: "That key was refused. HTTP 401" in page.find("#key-reason").text, 30, "the refusal")
    page.find("#api-key").send_keys(API_KEY + "\n")
    wait_until(lambda: not page.find("#key-form").is_displayed(), 30, "the key to be accepted")
    assert page.js("return sessionStorage.getItem('pagedserve.apiKey')") == API_KEY
    assert page.js("return [...document.querySelectorAll('#model option')].map(o => o.value)") == [
        "smollm2-135m-instruct"]

    # Temperature 0 (the control as a user moves it) for an answer that is always the same.
    page.set_value("#temperature", "0")
    assert page.find("#temperature-value").text == "0"
    page.record_reply_growth()
    page.ask("What is the capital of France?")
    reply = page.wait_reply("done", 90)
    assert "Paris" in reply["text"]
    seen = page.js("return window.seen")
    assert len([text for text in seen if text]) >= 2 and seen[-1] == reply["text"], seen  # it streamed in
    assert float(reply["ttft"]) > 0 and float(reply["tps"]) > 0
    assert "TTFT" in reply["stats"] and "tokens/s" in reply["stats"]
    assert "temperature=0.0" in server.log()  # the request carried the page's temperature

    # A long reply, stopped midway: the fetch is aborted, and so is the request on the server.
    aborted_before = aborted_requests(server)
    page.set_value("#temperature", "0.8")
    page.set_value("#max-tokens", "1000")
    page.ask("Write a very long story about a dragon who learns to cook, in many chapters.")
    wait_until(lambda: len(r := page.replies()) == 2 and len(r[-1]["text"]) > 40, 60, "the story to start")
    page.find("#stop-button").click()
    stopped = page.wait_reply("stopped", 10)
    assert "stopped" in stopped["stats"]
    wait_until(lambda: aborted_requests(server) == aborted_before + 1, 30, "the server to count the abort")
    assert "temperature=0.8" in server.log()

    # Regenerate replaces the stopped reply with a new one (stopped again here, to keep the test short).
    page.find("#regenerate").click()
    wait_until(lambda: page.replies()[-1]["state"] == "streaming" and page.replies()[-1]["text"], 60,
               "the regenerated reply")
    assert len(page.replies()) == 2
    page.find("#stop-button").click()
    page.wait_reply("stopped", 10)
    wait_until(lambda: aborted_requests(server) == aborted_before + 2, 30, "the second abort")

    # Bad input: the server's 400, as it said it, in the reply.
    page.set_value("#max-tokens", "-5")
    page.ask("Hello")
    error = page.wait_reply("error", 30)
    assert error["text"].startswith("HTTP 400") and "max_tokens" in error["text"], error["text"]

    # Model text is shown, never run: the renderer escapes it before adding its few constructs.
    html = page.js("return renderMarkdown(arguments[0])",
                   "**Paris** <img src=x onerror=alert(1)> [a](javascript:alert(1)) [b](https://example.com)")
    assert html.startswith("<p><strong>Paris</strong> &lt;img src=x onerror=alert(1)&gt; [a](javascript:")
    assert '<a href="https://example.com" target="_blank" rel="noopener noreferrer">b</a>' in html

    # The live panel from /metrics, against the server's numbers.
    wait_until(lambda: page.find("#m-kv").text.endswith("%"), 10, "the KV-cache use")
    assert page.find("#metrics-state").text == "live"
    wait_until(lambda: page.find("#m-running").text == page.find("#m-waiting").text == "0", 10, "an idle server")
    wait_until(lambda: page.find("#m-tps").text != "–", 10, "a tokens/s rate (it needs two scrapes)")
    assert float(page.find("#m-tps").text) >= 0
    samples = metric_samples(server)  # idle: the panel's hit rate is the one since the start
    hit_rate = samples["pagedserve:prefix_cache_hits_total"] / samples["pagedserve:prefix_cache_queries_total"] * 100
    wait_until(lambda: page.find("#m-prefix").text == f"{hit_rate:.1f} %", 10, f"a prefix hit rate of {hit_rate:.1f} %")
    assert page.find("#m-kv").text == f"{100 * samples['pagedserve:kv_cache_usage_perc']:.1f} %"
    # Data parallel: one series per replica; the KV-cache use is their mean, request counts their sum.
    two_replicas = page.js("return parseMetrics(arguments[0])", "\n".join([
        '# TYPE pagedserve:kv_cache_usage_perc gauge',
        'pagedserve:kv_cache_usage_perc{model_name="m",replica="0"} 0.5',
        'pagedserve:kv_cache_usage_perc{model_name="m",replica="1"} 0.25']))
    assert two_replicas == {"sum": {"pagedserve:kv_cache_usage_perc": 0.75},
                            "count": {"pagedserve:kv_cache_usage_perc": 2}}

    screenshot = tmp_path / "playground.png"
    assert browser.save_screenshot(str(screenshot))
    assert_not_blank(screenshot)


def assert_not_blank(png_path) -> None:
    from PIL import Image

    image = Image.open(png_path).convert("L")
    assert image.size[0] >= 800 and image.size[1] >= 500, image.size
    histogram = image.histogram()
    dominant = max(histogram) / sum(histogram)
    extrema = image.getextrema()
    assert dominant < 0.9 and extrema[1] - extrema[0] > 100, (dominant, extrema)
