r"""Build the docs, check every page at 1280 px, and screenshot some.

    python docs/screenshot_check.py                 # build into docs/_build/screenshot
    python docs/screenshot_check.py --html DIR      # check an existing HTML build

Needs Chromium (Debian: ``apt-get install chromium``); not run in CI. Every HTML page of
the build is opened at 1280 px. Exits 1 when an expected page is missing, a screenshot is
blank, the maths did not typeset, or any page

* shows an error box: Furo's red "Adding a table of contents ... is unnecessary" (a
  ``.. contents::``), an ``error`` admonition, a docutils ``system-message`` or a
  ``problematic`` node, or any element whose ``::before`` text starts with "ERROR";
* has a code block, figure, table or equation wider than its column (its end hidden);
* breaks a word inside a table cell (a word split over two lines, not at a hyphen);
* shows a figure whose smallest text is under ``MIN_FONT_PX`` on screen: a PNG written
  by ``benchmarks/studies/common.save_figure`` records its smallest text in pixels
  (``cl-min-font-px``), scaled here by the width the page shows it at; another image
  may not be shown at under ``MIN_SCALE`` of its natural width;
* is long (over 3000 px) with no visible "On this page" list;
* shows a lost escape (read from the HTML, no browser needed): a control character in
  the text, or a TAB inside maths, where a docstring that is not raw turned ``\tau``
  into a TAB and "au" (``\frac``, ``\beta``, ``\alpha`` into a form feed, backspace
  or bell and the rest of the word).

It prints one line per page and the PNG paths, and a total.

MathJax: the build copies a local MathJax into ``_static/mathjax`` when one is installed
(``docs/_ext/cl_mathjax.py``: the ``docs`` extra's django-static-mathjax, else Debian's
``libjs-mathjax``), else it loads the CDN, which offline shows raw TeX. ``--mathjax DIR``
picks a local copy, ``--mathjax cdn`` forces the CDN, ``--mathjax URL`` sets
``mathjax_path``. When the page loads a local MathJax, the check also requires that it
typeset the method page's equations.
"""

from __future__ import annotations

import argparse
import html as html_lib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

PAGES = [
    "index",
    "methods/infonce",
    "methods/siglip",
    "methods/kcl",
    "methods/cacl",
    "methods/svr",
    "methods/ask",
    "trainer",
    "checkpoints",
    "metrics",
    "example",
    "benchmarks",
    "real_data",
    "which_loss",
    "studies/multilingual",
    "studies/svr",
    "studies/svr_regimes",
    "studies/ask",
    "studies/real_multilingual_v1",
    "large_batches",
    "performance",
    "api/index",
    "changelog",
    "genindex",
    "search",
]
SHOTS = {
    "landing": "index",
    "method": "methods/kcl",
    "trainer": "trainer",
    "svr": "methods/svr",
    "performance": "performance",
}
WIDTH = 1280
MIN_FONT_PX = 9.0  # smallest readable figure text on screen (Furo's body text is 16 px)
MIN_SCALE = 0.8  # an image without a font record: shown at least at 80 % of its width
FONT_KEY = "cl-min-font-px"  # benchmarks/studies/common.py: MIN_FONT_KEY
LONG_PAGE = 3000  # px; a longer page needs its "On this page" list on screen
UNSECTIONED = {"genindex", "search", "py-modindex"}  # Sphinx's own pages: no sections

# Run in the page after load; the result lands in <pre id=cl-layout> as JSON:
# * cut: every code block, image, table and display equation of the article whose
#   content is wider than its box or that sticks out of the article;
# * errors: error boxes (Furo's styling of a contents directive, error admonitions,
#   docutils system messages and problematic nodes, any ::before "ERROR" text);
# * broken: words of table cells that the browser split over two lines;
# * images: each image's source, natural and shown width;
# * toc: whether the "On this page" list is on screen; height: the page's height.
LAYOUT_PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const main = document.querySelector("article[role=main]") || document.body;
  const edge = main.getBoundingClientRect().right + 4;  // a table's border may overhang
  const short = (el) => (el.getAttribute("src") || el.textContent || "").trim()
    .slice(0, 80).replace(/\\s+/g, " ");
  const cut = [];
  for (const el of main.querySelectorAll("pre, img, table, div.math")) {
    const box = el.getBoundingClientRect();
    if (el.scrollWidth > el.clientWidth + 1 || box.right > edge) {
      const by = Math.max(el.scrollWidth - el.clientWidth, box.right - edge + 4);
      cut.push(el.tagName.toLowerCase() + " (" + Math.round(by) + " px over): " + short(el));
    }
  }
  const errors = [];
  const boxes = ".contents:not(.this-will-duplicate-information-and-it-is-still-useful-here)"
    + ", .admonition.error, .system-message, .problematic";
  for (const el of document.querySelectorAll(boxes)) {
    errors.push(el.tagName.toLowerCase() + "." + el.className + ": " + short(el));
  }
  for (const el of main.querySelectorAll("*")) {
    const before = getComputedStyle(el, "::before").content || "";
    if (/^["']ERROR/.test(before) && !el.matches(boxes)) {
      errors.push(el.tagName.toLowerCase() + "." + el.className + ": " + before.slice(0, 80));
    }
  }
  const broken = [];
  for (const cell of main.querySelectorAll("td, th")) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const m of node.data.matchAll(/[^\\s\\-\\/\u2013\u2014]+/g)) {
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        if (lines.size > 1) broken.push(m[0]);
      }
    }
  }
  const images = [...main.querySelectorAll("img")].map((img) => ({
    src: img.getAttribute("src"), natural: img.naturalWidth,
    shown: img.getBoundingClientRect().width}));
  const toc = document.querySelector(".toc-drawer");
  const box = toc ? toc.getBoundingClientRect() : null;
  const tocShown = !!box && box.width > 0 && box.left >= 0 && box.right <= innerWidth + 1;
  const out = document.createElement("pre");
  out.id = "cl-layout";
  out.textContent = JSON.stringify({cut: cut, errors: errors, broken: broken, images: images,
                                    toc: tocShown, height: document.body.scrollHeight});
  document.body.appendChild(out);
}, 1000));
</script>"""


def api_pages() -> list[str]:
    """One page per module of conf.API_MODULES that exists in this checkout."""
    sys.path.insert(0, str(ROOT / "src"))
    namespace: dict[str, object] = {"__file__": str(DOCS / "conf.py")}
    source = (DOCS / "conf.py").read_text()
    start = source.index("API_MODULES = [")
    exec(source[start : source.index("]", start) + 1], namespace)
    modules = namespace["API_MODULES"]
    assert isinstance(modules, list)
    return [f"api/generated/{m}" for m in modules if importlib.util.find_spec(m)]


def build(out: Path, mathjax: str | None) -> Path:
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    env = dict(os.environ)
    if mathjax and "://" in mathjax:
        cmd += ["-D", f"mathjax_path={mathjax}"]
    elif mathjax:
        env["CL_DOCS_MATHJAX"] = mathjax  # "cdn" or a folder
    cmd += ["-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    subprocess.run(cmd, check=True, env=env)
    return out / "html"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    sys.exit("screenshot_check: Chromium not found (apt-get install chromium)")


def chromium_cmd(*args: str) -> list[str]:
    return [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tempfile.mkdtemp(prefix='cl-chromium-')}",
        "--hide-scrollbars",
        "--virtual-time-budget=15000",  # let MathJax typeset before the shot
        *args,
    ]


def screenshot(page: Path, png: Path, height: int = 900) -> None:
    cmd = chromium_cmd(f"--screenshot={png}", f"--window-size={WIDTH},{height}", page.as_uri())
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def rendered_dom(page: Path) -> str:
    cmd = chromium_cmd("--dump-dom", f"--window-size={WIDTH},900", page.as_uri())
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout


def layout(page: Path) -> dict:
    """What LAYOUT_PROBE finds on ``page`` at WIDTH px (a probed copy beside it)."""
    probed = page.with_name(page.stem + ".cl-layout.html")
    text = page.read_text(encoding="utf-8")
    probed.write_text(text.replace("</body>", LAYOUT_PROBE + "</body>"), encoding="utf-8")
    try:
        dom = rendered_dom(probed)
    finally:
        probed.unlink()
    start = dom.find('<pre id="cl-layout">')
    if start < 0:
        return {"cut": ["the layout probe did not run"], "toc": False, "height": 0}
    body = dom[start + len('<pre id="cl-layout">') : dom.index("</pre>", start)]
    return json.loads(html_lib.unescape(body))


def png_chunks(png: Path) -> Iterator[tuple[bytes, bytes]]:
    """``(kind, body)`` of each chunk of a PNG file."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
    pos = 8
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        yield data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length


def png_text(png: Path) -> dict[str, str]:
    """The PNG's ``tEXt`` entries (matplotlib's ``savefig(metadata=...)``)."""
    entries = {}
    for kind, body in png_chunks(png):
        if kind == b"tEXt" and b"\0" in body:
            key, value = body.split(b"\0", 1)
            entries[key.decode("latin-1")] = value.decode("latin-1")
    return entries


def png_pixels(png: Path) -> tuple[int, int, bytes]:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) to raw unfiltered rows."""
    idat, width, height, channels = b"", 0, 0, 0
    for kind, body in png_chunks(png):
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            channels = {2: 3, 6: 4}[body[9]]
            assert body[8] == 8, "only 8-bit PNGs"
        elif kind == b"IDAT":
            idat += body
    raw, stride = zlib.decompress(idat), width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for x in range(stride):
            a = line[x - channels] if x >= channels else 0
            b, c = prev[x], prev[x - channels] if x >= channels else 0
            if kind == 1:
                line[x] = (line[x] + a) & 255
            elif kind == 2:
                line[x] = (line[x] + b) & 255
            elif kind == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, b"".join(rows)


def ink_share(png: Path) -> float:
    """Share of pixels that differ from the most common (background) colour."""
    width, height, pixels = png_pixels(png)
    channels = len(pixels) // (width * height)
    step = channels * 7  # every 7th pixel is plenty
    samples = [pixels[i : i + 3] for i in range(0, len(pixels) - 3, step)]
    background = max(set(samples), key=samples.count)
    return sum(s != background for s in samples) / len(samples)


def all_pages(html: Path) -> list[str]:
    """Every page of the build (``methods/kcl``), without Sphinx's own folders."""
    pages = [
        p.relative_to(html).with_suffix("").as_posix()
        for p in html.rglob("*.html")
        if not p.relative_to(html).parts[0].startswith("_") and ".cl-layout" not in p.name
    ]
    return sorted(pages)


def figure_problems(page: Path, images: list[dict]) -> list[str]:
    """Images on ``page`` whose smallest text is under MIN_FONT_PX as shown (see the
    module doc); ``images`` as LAYOUT_PROBE reports them."""
    problems = []
    for image in images:
        if not image["natural"] or not image["shown"]:
            problems.append(f"image {image['src']} did not load")
            continue
        scale = image["shown"] / image["natural"]
        path = (page.parent / image["src"].split("?")[0]).resolve()
        record = png_text(path).get(FONT_KEY) if path.suffix == ".png" else None
        if record is not None and float(record) * scale < MIN_FONT_PX:
            problems.append(
                f"figure {image['src']}: smallest text {float(record) * scale:.1f} px on "
                f"screen ({record} px at {image['natural']} px wide, shown "
                f"{image['shown']:.0f} px), under {MIN_FONT_PX:.0f} px"
            )
        elif record is None and scale < MIN_SCALE:
            problems.append(
                f"image {image['src']}: shown at {scale:.0%} of its width "
                f"({image['natural']} -> {image['shown']:.0f} px), no font record"
            )
    return problems


# Characters a lost escape leaves in a page: bell, backspace, vertical tab, form feed and
# the other C0 controls (TAB, LF and CR are layout); inside maths a TAB too.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_MATH = re.compile(r"\\\((.*?)\\\)|\\\[(.*?)\\\]", re.S)
_NAMES = {"\t": "TAB", "\x07": "BEL", "\x08": "BS", "\x0b": "VT", "\x0c": "FF"}


def escape_problems(text: str) -> list[str]:
    r"""Lost escapes in a page's HTML ``text`` (see the module doc), with their context:
    ``1/<TAB>au`` is the ``1/\tau`` of a docstring that is not raw."""

    def shown(snippet: str) -> str:
        for char, name in _NAMES.items():
            snippet = snippet.replace(char, f"<{name}>")
        return _CONTROL.sub(lambda m: f"<0x{ord(m.group()):02x}>", snippet)

    problems = []
    for m in _CONTROL.finditer(text):
        context = text[max(0, m.start() - 30) : m.end() + 10]
        problems.append(f"lost escape: control character in {shown(context)!r}")
    for m in _MATH.finditer(text):
        math = m.group(1) if m.group(1) is not None else m.group(2)
        if "\t" in math:
            problems.append(f"lost escape: TAB in maths {shown(math[:60])!r} (a \\t... command)")
    return problems


def page_problems(html: Path, page: str) -> list[str]:
    """Everything LAYOUT_PROBE finds wrong on ``page`` at WIDTH px; prints a summary."""
    found = layout(html / f"{page}.html")
    problems = escape_problems((html / f"{page}.html").read_text(encoding="utf-8"))
    problems += [f"cut: {c}" for c in found["cut"]]
    problems += [f"error box: {e}" for e in found.get("errors", [])]
    problems += [f"word broken in a table cell: {w!r}" for w in found.get("broken", [])]
    problems += figure_problems(html / f"{page}.html", found.get("images", []))
    if found["height"] > LONG_PAGE and not found["toc"] and page not in UNSECTIONED:
        problems.append(f"{found['height']} px long, no 'On this page' list")
    print(f"{page}.html at {WIDTH} px: {len(found.get('images', []))} images, "
          f"{found['height']} px tall, 'On this page' {'shown' if found['toc'] else 'hidden'}"
          f": {len(problems)} problems")  # fmt: skip
    return [f"{page}.html: {p}" for p in problems]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", type=Path, help="existing HTML build (skip building)")
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "screenshot")
    parser.add_argument("--mathjax", default=None, help="a MathJax folder, a URL, or 'cdn'")
    parser.add_argument("--pages", nargs="*", help="check only these pages (e.g. real_data)")
    args = parser.parse_args()
    args.out = args.out.resolve()  # file URIs need absolute paths
    html = args.html.resolve() if args.html else build(args.out, args.mathjax)
    failures = []
    missing = [p for p in PAGES + api_pages() if not (html / f"{p}.html").is_file()]
    if missing:
        failures.append(f"missing pages: {missing}")
    shots = args.out / "png"
    shots.mkdir(parents=True, exist_ok=True)
    for label, page in SHOTS.items():
        if page in missing or args.pages:
            continue
        png = shots / f"{label}.png"
        screenshot(html / f"{page}.html", png)
        share = ink_share(png)
        print(f"{png}  ({page}.html, {share:.1%} non-background pixels)")
        if share < 0.01:
            failures.append(f"{png} is blank ({share:.2%} non-background pixels)")
    pages = args.pages or all_pages(html)
    bad_pages = 0
    for page in pages:
        problems = page_problems(html, page)
        bad_pages += bool(problems)
        failures += problems
    print(f"{len(pages)} pages checked at {WIDTH} px, {bad_pages} with problems")
    method = html / f"{SHOTS['method']}.html"
    if method.is_file() and "_static/mathjax/" in method.read_text(encoding="utf-8"):
        dom = rendered_dom(method)
        # typeset output: <mjx-container> (MathJax 3/4), <span class="MathJax..."> (2)
        if "<mjx-container" not in dom and 'class="MathJax' not in dom:
            failures.append(f"{SHOTS['method']}.html: MathJax did not typeset the equations")
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
