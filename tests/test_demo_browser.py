"""The demo as a person uses it: headless Debian Chromium driven by Playwright, against the demo
launched in-process on 127.0.0.1. In each tab: fill the inputs, click, wait for the result, check
the stats and the per-token picture, trigger a bad input and read the error in the page; save
screenshots under the test's temp folder (``MMSPEC_DEMO_SCREENSHOT=path.png`` also saves the AR
tab's screenshot there: how ``assets/demo.png`` was made).

Chromium comes from Debian (``apt-get install chromium``; ``.ci/run`` installs it when missing) and
Playwright from PyPI (the ``test`` extra); no browser is downloaded. Without either, the tests skip
with the reason on a developer's machine and fail under CI (``CI`` set), never pass silently.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT = 180_000  # ms: first requests load the models on a busy 2-core machine


def _missing(what: str):
    msg = f"the browser test needs {what}"
    if os.environ.get("CI"):
        pytest.fail(msg + " (CI must install it: see .ci/run)")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def demo_url():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    sys.path.insert(0, str(ROOT))
    from demos import app

    app.demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    yield app.demo.local_url
    app.demo.close()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright (pip install -e '.[test]')")
    if CHROMIUM is None:
        _missing("Debian's chromium (apt-get install -y chromium)")
    with sync_playwright() as p:
        try:
            chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        except Exception as err:  # say why Chromium did not start
            _missing(f"a Chromium that starts ({CHROMIUM}: {str(err).splitlines()[0]})")
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, demo_url):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(demo_url, wait_until="networkidle")
    yield page
    page.close()


def _text(page, selector: str) -> str:
    return page.locator(selector).inner_text()


def _wait_text(page, selector: str, needle: str):
    page.wait_for_function("([sel, needle]) => { const el = document.querySelector(sel);"
                           " return el && el.innerText.includes(needle); }", arg=[selector, needle], timeout=TIMEOUT)


def _image_width(page, selector: str) -> int:
    img = page.wait_for_selector(f"{selector} img", state="visible", timeout=TIMEOUT)
    page.wait_for_function("el => el.complete && el.naturalWidth > 0", arg=img, timeout=TIMEOUT)
    return img.evaluate("el => el.naturalWidth")


def _drawn_width(page, selector: str) -> float:
    """The width in CSS pixels the page draws the image of ``selector`` at (its element's box,
    the picture scaled into it keeping its aspect: object-fit contain)."""
    img = page.wait_for_selector(f"{selector} img", state="visible", timeout=TIMEOUT)
    page.wait_for_function("el => el.complete && el.naturalWidth > 0", arg=img, timeout=TIMEOUT)
    return img.evaluate("""el => { const r = el.getBoundingClientRect(), s = getComputedStyle(el);
        const k = s.objectFit === 'contain' ? Math.min(r.width / el.naturalWidth, r.height / el.naturalHeight)
                : Math.min(1, r.width / el.naturalWidth, r.height / el.naturalHeight);
        return s.imageRendering === 'pixelated' ? k * el.naturalWidth : -1; }""")


FILLED = 140  # CSS px: a 64-pixel image drawn nearest-neighbour over most of its 192-pixel box (150 measured)


def _bad_input(page, tab: str, field: str, value: str, message: str, shot) -> None:
    """Fill ``field`` (a CSS selector) with ``value``, run ``tab``: ``message`` shows in the tab's
    error box, the page stays alive (no traceback); screenshot to ``shot``."""
    page.fill(field, value)
    page.click(f"#{tab}-run")
    _wait_text(page, f"#{tab}-error", message)
    assert "Traceback" not in page.content()
    page.screenshot(path=str(shot), full_page=True)


def test_ar_tab(page, tmp_path):
    page.fill("#ar-seed input", "3")
    page.click("#ar-run")
    _wait_text(page, "#ar-ours-stats", "speed-up")
    assert _image_width(page, "#ar-base-img") == 64  # the generated images, decoded in the page
    assert _image_width(page, "#ar-ours-img") == 64
    assert _image_width(page, "#ar-grid-img") == 256  # the 16 x 16 per-token picture
    for box in ("#ar-base-img", "#ar-ours-img", "#ar-grid-img"):  # drawn to fill the box, not as thumbnails
        assert _drawn_width(page, box) >= FILLED, box
    base, ours = _text(page, "#ar-base-stats"), _text(page, "#ar-ours-stats")
    assert "NFE 256" in base and "tau 1.00" in base
    assert "gsd" in ours and "NFE" in ours and "tau" in ours
    assert "lossy" in ours and "p(requested class)" in ours  # lossy, beside a quality figure
    assert "passes for 256 tokens" in ours
    assert _text(page, "#ar-error").strip() == ""
    page.screenshot(path=str(tmp_path / "ar.png"), full_page=True)
    if os.environ.get("MMSPEC_DEMO_SCREENSHOT"):
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=os.environ["MMSPEC_DEMO_SCREENSHOT"], full_page=True)

    # a bad knob: the message appears in the page, the page stays alive
    _bad_input(page, "ar", "#ar-knob-sjd_window input", "1", "sjd_window must be an int >= 2", tmp_path / "ar-error.png")

    # the method dropdown shows that method's knobs (from the registry) and hides the others
    page.click("#ar-method input")
    page.click('#ar-method li[aria-label="sd"]')
    page.wait_for_selector("#ar-knob-sd_gamma", state="visible", timeout=TIMEOUT)
    assert page.locator("#ar-knob-sjd_window").is_hidden()


def test_vlm_tab(page, tmp_path):
    page.get_by_role("tab", name="VLM").click()
    page.wait_for_selector("#vlm-run", state="visible", timeout=TIMEOUT)
    assert _image_width(page, "#vlm-image") == 64 and _drawn_width(page, "#vlm-image") >= FILLED  # the scene
    # record every text the answer box shows while it streams
    page.evaluate("""() => { window.seen = []; const el = document.querySelector('#vlm-answer');
        new MutationObserver(() => window.seen.push(el.innerText)).observe(el, {subtree: true, childList: true,
        characterData: true}); }""")
    page.fill("#vlm-max-new input", "96")
    page.click("#vlm-run")
    _wait_text(page, "#vlm-ours-stats", "Greedy answer equal")
    ours = _text(page, "#vlm-ours-stats")
    assert "yes, token for token" in ours and "tau" in ours and "speed-up" in ours
    assert "came from accepted drafts" in ours
    assert "NFE" in _text(page, "#vlm-base-stats")
    answer = " ".join(_text(page, "#vlm-answer").split())
    assert "the image shows" in answer or "this picture" in answer or "in this image" in answer
    # the drafted words are the marked ones, as many as the stats say
    drafted, words = map(int, re.search(r"(\d+) of (\d+) words came from accepted drafts", ours).groups())
    assert 0 < drafted < words
    assert page.locator("#vlm-answer .token.highlighted").count() == drafted
    assert page.locator("#vlm-answer .token").count() == words
    # the answer streamed word by word: several growing prefixes of the final answer came first
    final = _text(page, "#vlm-answer").split()
    partial = {tuple(s.split()) for s in page.evaluate("window.seen") if "the" in s.split()}
    growing = [p for p in partial if len(p) < len(final) and list(p) == final[:len(p)]]
    assert len(growing) >= 2, partial
    page.screenshot(path=str(tmp_path / "vlm.png"), full_page=True)

    _bad_input(page, "vlm", "#vlm-question textarea", "", "question must be a non-empty question",
               tmp_path / "vlm-error.png")


def test_continuous_tab(page, tmp_path):
    """The continuous-token tab opens on ``sjd`` (the lossless method faster than the target alone
    in ``mmspec bench continuous``), runs it beside the baseline and labels it lossless."""
    page.get_by_role("tab", name="Continuous tokens").click()
    page.wait_for_selector("#cont-run", state="visible", timeout=TIMEOUT)
    assert page.locator("#cont-method input").input_value() == "sjd"
    assert page.locator("#cont-knob-sjd_window").is_visible()
    page.click("#cont-run")
    _wait_text(page, "#cont-ours-stats", "speed-up")
    assert _image_width(page, "#cont-base-img") == 64
    assert _image_width(page, "#cont-ours-img") == 64
    assert min(_drawn_width(page, "#cont-base-img"), _drawn_width(page, "#cont-ours-img")) >= FILLED
    base, ours = _text(page, "#cont-base-stats"), _text(page, "#cont-ours-stats")
    assert "NFE 64" in base and "tau 1.00" in base  # 8 x 8 tokens, one per target pass
    assert "sjd: lossless" in ours and "p(requested class)" in ours
    nfe = int(re.search(r"NFE (\d+)", ours).group(1))
    assert nfe < 64, ours  # the Jacobi window committed several tokens in some pass
    assert _text(page, "#cont-error").strip() == ""
    page.screenshot(path=str(tmp_path / "continuous.png"), full_page=True)

    _bad_input(page, "cont", "#cont-knob-sjd_window input", "1", "sjd_window must be an int >= 2",
               tmp_path / "continuous-error.png")


def test_video_tab(page, tmp_path):
    page.get_by_role("tab", name="Streaming video").click()
    page.wait_for_selector("#video-run", state="visible", timeout=TIMEOUT)
    # record every progress line the page shows while the stream runs
    page.evaluate("""() => { window.progress = []; const el = document.querySelector('#video-progress');
        new MutationObserver(() => window.progress.push(el.innerText)).observe(el, {subtree: true, childList: true,
        characterData: true}); }""")
    page.fill("#video-frames input", "60")
    page.fill("#video-switch-frame input", "30")
    page.click("#video-run")
    _wait_text(page, "#video-stats", "re-cache at frames [30]")
    stats = _text(page, "#video-stats")
    assert "rolling" in stats and "60 frames, 20 chunks" in stats and "fps" in stats and "cache 12 frames" in stats
    assert _image_width(page, "#video-latest") == 256  # the last frame, 8x
    assert _drawn_width(page, "#video-latest") >= 200  # filling its 256-pixel box
    assert _image_width(page, "#video-strip") == 16 * 64  # one frame per chunk, 2x, 16 per row
    # the MP4 plays in Chromium: its metadata loads and it has the clip's size
    video = page.wait_for_selector("#video-clip video", state="attached", timeout=TIMEOUT)
    page.wait_for_function("el => el.readyState >= 1 && el.videoWidth > 0", arg=video, timeout=TIMEOUT)
    assert video.evaluate("el => [el.videoWidth, el.videoHeight]") == [256, 256]
    assert abs(video.evaluate("el => el.duration") - 60 / 16) < 0.2
    # chunks showed up as they were decoded: the frame count grew before the stream ended
    counts = [int(m.group(1)) for s in page.evaluate("window.progress")
              if (m := re.search(r"frame (\d+) of 60", s))]
    assert len(set(counts)) >= 2 and counts == sorted(counts) and counts[-1] == 60, counts
    assert "blue" in _text(page, "#video-progress")  # the prompt in force after the switch
    assert _text(page, "#video-error").strip() == ""
    page.screenshot(path=str(tmp_path / "video.png"), full_page=True)

    _bad_input(page, "video", "#video-switch-frame input", "31",
               "switch frame must be a multiple of the model's chunk (3 frames)", tmp_path / "video-error.png")
