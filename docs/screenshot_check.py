"""Build the docs, check every expected page exists, screenshot some, and check that
nothing is cut at 1280 px.

    python docs/screenshot_check.py                 # build into docs/_build/screenshot
    python docs/screenshot_check.py --html DIR      # check an existing HTML build

Needs Chromium (Debian: ``apt-get install chromium``); not run in CI. Exits 1 when a page
is missing, a screenshot is blank, the maths did not typeset, a page of ``CUT_CHECK`` shows
a code block, figure, table or equation wider than its column at 1280 px (its end hidden),
or a long page has no visible "On this page" list there. Prints the PNG paths.

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
import shutil
import subprocess
import sys
import tempfile
import zlib
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
CUT_CHECK = ["trainer", "methods/svr", "performance", "large_batches", "index"]
WIDTH = 1280

# Run in the page after load: every code block, image, table and display equation of the
# article whose content is wider than its box or that sticks out of the article, and
# whether the "On this page" list is on screen. The result lands in <pre id=cl-layout>.
LAYOUT_PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const main = document.querySelector("article[role=main]") || document.body;
  const edge = main.getBoundingClientRect().right + 4;  // a table's border may overhang
  const cut = [];
  for (const el of main.querySelectorAll("pre, img, table, div.math")) {
    const box = el.getBoundingClientRect();
    if (el.scrollWidth > el.clientWidth + 1 || box.right > edge) {
      const what = (el.getAttribute("src") || el.textContent || "").trim();
      const by = Math.max(el.scrollWidth - el.clientWidth, box.right - edge + 4);
      cut.push(el.tagName.toLowerCase() + " (" + Math.round(by) + " px over): "
               + what.slice(0, 80).replace(/\\s+/g, " "));
    }
  }
  const toc = document.querySelector(".toc-drawer");
  const box = toc ? toc.getBoundingClientRect() : null;
  const tocShown = !!box && box.width > 0 && box.left >= 0 && box.right <= innerWidth + 1;
  const out = document.createElement("pre");
  out.id = "cl-layout";
  out.textContent = JSON.stringify({cut: cut, toc: tocShown, height: document.body.scrollHeight});
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


def png_pixels(png: Path) -> tuple[int, int, bytes]:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) to raw unfiltered rows."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            channels = {2: 3, 6: 4}[body[9]]
            assert body[8] == 8, "only 8-bit PNGs"
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", type=Path, help="existing HTML build (skip building)")
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "screenshot")
    parser.add_argument("--mathjax", default=None, help="a MathJax folder, a URL, or 'cdn'")
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
        if page in missing:
            continue
        png = shots / f"{label}.png"
        screenshot(html / f"{page}.html", png)
        share = ink_share(png)
        print(f"{png}  ({page}.html, {share:.1%} non-background pixels)")
        if share < 0.01:
            failures.append(f"{png} is blank ({share:.2%} non-background pixels)")
    for page in CUT_CHECK:
        if page in missing:
            continue
        found = layout(html / f"{page}.html")
        print(f"{page}.html at {WIDTH} px: {len(found['cut'])} cut, 'On this page' "
              f"{'shown' if found['toc'] else 'hidden'}, {found['height']} px tall")  # fmt: skip
        failures += [f"{page}.html: cut at {WIDTH} px: {c}" for c in found["cut"]]
        if found["height"] > 3000 and not found["toc"]:
            failures.append(f"{page}.html: {found['height']} px long, no 'On this page' list")
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
