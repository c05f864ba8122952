"""The Snakemake report (`snakemake --report report.html`) opened in a real headless browser: the
system's Chromium (`make setup-browser` installs it), driven by playwright, clicks its way to every
figure the way a person would and checks that each one renders, and that none of its text (a
legend's, a title's) runs past the figure's edge. Screenshots of the landing page and of each
figure are saved under the test's tmp_path, and their paths printed."""

import base64
import os
import re
import shutil
from pathlib import Path

from playwright.sync_api import sync_playwright

from eaglenest.report.evaluate import plot_acceptance, plot_speed
from test_report import write_metrics

# Debian's `chromium` package; playwright never downloads a browser of its own here.
CHROMIUM = "/usr/bin/chromium"
# As root, in a closed network: no sandbox (root), no GPU, and none of Chromium's own background
# connections (refused by the closed network, they would only add errors and delays).
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1920, "height": 1080}  # a desktop screen
IMAGE_TYPES = ("image/svg+xml", "image/png", "image/jpeg")
TIMEOUT_MS = 15_000

# The report's figure on display: its <img> in the content pane (the navbar holds the logo's).
SHOWN_IMAGES = "[...document.querySelectorAll('#app img')].filter(img => !img.closest('nav'))"
# Whether the content pane shows the image with this data: URI (and has loaded it, or failed to).
SHOWS = "src => { const imgs = %s; return imgs.length == 1 && imgs[0].src == src && imgs[0].complete; }" % SHOWN_IMAGES
# The figure's rendering: decoded, its natural and laid-out size and place, and how many distinct
# colours a 64x64 rendering of it has (a blank image has one).
RENDERED = """async () => {
    const [img] = %s;
    try {
        await img.decode();
    } catch (error) {
        return {src: img.src, error: String(error)};
    }
    const canvas = document.createElement('canvas');
    canvas.width = canvas.height = 64;
    const context = canvas.getContext('2d');
    context.drawImage(img, 0, 0, 64, 64);
    const pixels = context.getImageData(0, 0, 64, 64).data;
    const colours = new Set();
    for (let i = 0; i < pixels.length; i += 4) colours.add(pixels.slice(i, i + 4).join());
    const box = img.getBoundingClientRect();
    return {src: img.src, naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
            width: box.width, height: box.height, left: box.left, right: box.right,
            navbarRight: document.querySelector('nav').getBoundingClientRect().right,
            screenWidth: window.innerWidth, colours: colours.size};
}""" % SHOWN_IMAGES


# The SVG's texts that Chromium draws, in the browser's own font, past the edge of the SVG's
# viewBox (where a browser cuts them off): "text: its box" each.
TEXT_OUTSIDE = """() => {
    const svg = document.querySelector('svg'), frame = svg.getBoundingClientRect();
    return [...svg.querySelectorAll('text')].map(text => [text.textContent.trim(), text.getBoundingClientRect()])
        .filter(([, box]) => box.left < frame.left - 1 || box.right > frame.right + 1
                             || box.top < frame.top - 1 || box.bottom > frame.bottom + 1)
        .map(([text, box]) => `${text}: x ${Math.round(box.left)} to ${Math.round(box.right)} of `
                              + `${Math.round(frame.width)}, y ${Math.round(box.top)} to ${Math.round(box.bottom)} `
                              + `of ${Math.round(frame.height)}`);
}"""


def text_outside(page, svg):
    """The texts of the SVG markup `svg` that Chromium draws past the figure's edge (TEXT_OUTSIDE),
    the SVG shown alone inline, at its own size."""
    page.set_content(svg)
    return page.evaluate(TEXT_OUTSIDE)


def launch(playwright, tmp_path):
    """Chromium, headless, with a desktop screen's viewport and a profile of its own under tmp_path."""
    return playwright.chromium.launch_persistent_context(
        tmp_path / "chromium-profile", executable_path=chromium(), headless=True, args=CHROMIUM_ARGS,
        viewport=VIEWPORT)


def chromium():
    """The system's Chromium; missing, it is an error (run `make setup-browser`), never a skip."""
    path = shutil.which("chromium") or CHROMIUM
    assert os.access(path, os.X_OK), f"no Chromium at {CHROMIUM} nor on PATH: run `make setup-browser`"
    return path


def slug(text):
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def results_menu(page):
    """The navbar menu's entries under "Results": one per category (a category may share its name
    with an entry under "General", e.g. "Workflow")."""
    heading = page.locator("nav ul > li").filter(has_text=re.compile(r"^\s*Results\s*$"))
    return heading.locator("xpath=following-sibling::li/a")


def open_category(page, category):
    """From the navbar's menu, click `category` among the Results."""
    results_menu(page).filter(has_text=re.compile(rf"^\s*{re.escape(category)}\s*$")).click()


def open_result(page, path, result):
    """Click the eye button of `path`'s row in the navbar's table of results, found as a person
    would: by its labels under the table's headers (or by its path, in a table of "File"s)."""
    table = page.locator("nav table")
    table.wait_for(timeout=TIMEOUT_MS)
    headers = [th.strip() for th in table.locator("thead th").all_text_contents()][:-1]
    labels = result["labels"] or {}
    expected = [path] if headers == ["File"] and "File" not in labels else [str(labels.get(h, "")) for h in headers]
    rows = table.locator("tbody tr")
    cells = rows.evaluate_all("rows => rows.map(row => [...row.cells].slice(0, -1).map(c => c.textContent.trim()))")
    assert expected in cells, f"{path}: no row {expected} in its table {headers}: {cells}"
    rows.nth(cells.index(expected)).locator('a[iconname="eye"]').click()


def show_figure(page, categories, category, subcategory, path, problems):
    """Click through the navbar to `path`: back to the menu, its category, its subcategory (when
    the category has several), its row's eye button; -> the figure's rendering (RENDERED)."""
    def clean(step):
        assert not problems, f"{path}: the page failed at {step}: {problems}"

    page.locator("nav ol a").first.click()  # the breadcrumbs' home: the menu
    clean("the menu")
    open_category(page, category)
    clean(f"the category {category!r}")
    if len(categories[category]) > 1:  # a list of subcategories first
        page.locator("nav ul a").filter(has_text=re.compile(rf"^\s*{re.escape(subcategory)}\s*$")).click()
        clean(f"the subcategory {subcategory!r}")
    open_result(page, path, page.evaluate("path => results[path]", path))
    clean("its eye button")
    page.wait_for_function(SHOWS, arg=page.evaluate("path => results[path].data_uri", path))
    shown = page.evaluate(RENDERED)
    del shown["src"]
    return shown


def test_report_renders_in_browser(report_html, tmp_path):
    shots = tmp_path / "screenshots"
    shots.mkdir()
    problems = []  # uncaught exceptions, console errors and failed requests, over the whole visit
    with sync_playwright() as playwright:
        context = launch(playwright, tmp_path)
        try:
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on("console", lambda msg: msg.type == "error" and problems.append(f"console error: {msg.text}"))
            page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url[:200]} {req.failure}"))
            page.goto(Path(report_html).resolve().as_uri(), wait_until="load")

            # The app rendered: its title, its navbar's heading, and the menu with every category.
            assert page.title() == "Snakemake Report"
            page.locator("nav h1").filter(has_text="Snakemake").wait_for()
            landing = shots / "00_landing.png"
            page.screenshot(path=landing, full_page=True)
            print(f"screenshot: {landing}")
            assert not problems, problems
            categories = page.evaluate("categories")
            menu = [text.strip() for text in results_menu(page).all_text_contents()]
            assert sorted(menu) == sorted(categories), f"the menu's Results: {menu}, the report's categories: {list(categories)}"

            mime_types = page.evaluate("Object.fromEntries(Object.entries(results).map(([p, r]) => [p, r.mime_type]))")
            figures = [(category, subcategory, path) for category, subcategories in categories.items()
                       for subcategory, paths in subcategories.items()
                       for path in paths if mime_types[path] in IMAGE_TYPES]
            assert figures, f"no figures in the report: {categories}"
            alone = context.new_page()  # an SVG figure shown alone, to measure its text
            for number, (category, subcategory, path) in enumerate(figures, 1):
                shot = shots / f"{number:02d}_{slug(category)}_{slug(path.rsplit('/', 1)[-1])}.png"
                try:
                    shown = show_figure(page, categories, category, subcategory, path, problems)
                finally:
                    page.screenshot(path=shot, full_page=True)
                    print(f"screenshot: {shot} ({category} / {subcategory} / {path})")
                print(f"  {shown}")
                assert "error" not in shown, f"{path} does not render: {shown['error']}"
                assert shown["naturalWidth"] > 0 and shown["naturalHeight"] > 0, (path, shown)
                assert shown["width"] > 50 and shown["height"] > 50, (path, shown)
                assert shown["colours"] > 1, f"{path} renders blank: {shown}"
                assert shown["navbarRight"] <= shown["left"] + 1 and shown["right"] <= shown["screenWidth"] + 1, \
                    f"{path} is cut off (beside the navbar, or past the screen's right edge): {shown}"
                assert not problems, (path, problems)
                if mime_types[path] == "image/svg+xml":
                    uri = page.evaluate("path => results[path].data_uri", path)
                    outside = text_outside(alone, base64.b64decode(uri.split("base64,", 1)[1]).decode())
                    assert not outside, f"{path}: text past the figure's edge: {outside}"
        finally:
            context.close()


def test_the_evaluation_figures_keep_their_text_inside(tmp_path):
    """The acceptance and speed figures, the widest legends, on small metrics (test_report's):
    every text, a legend's last entry included, inside the figure as Chromium draws it."""
    write_metrics(tmp_path)
    with sync_playwright() as playwright:
        context = launch(playwright, tmp_path)
        try:
            for plot in (plot_acceptance, plot_speed):
                svg, shot = tmp_path / f"{plot.__name__}.svg", tmp_path / f"{plot.__name__}.png"
                plot(tmp_path / "offline.json", tmp_path / "vllm.json", svg)
                page = context.new_page()
                outside = text_outside(page, svg.read_text())
                page.screenshot(path=shot, full_page=True)
                print(f"screenshot: {shot}")
                assert not outside, f"{svg.name}: text past the figure's edge: {outside}"
        finally:
            context.close()
