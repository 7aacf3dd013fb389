"""Looks at the docs site as a reader's browser shows it: headless Chromium (Debian's `chromium`) opens every page
at a desktop and a phone width and reports what does not fit.

    python tools/site_look.py                      # the report
    python tools/site_look.py --screenshots shots  # and a PNG of each page's first screen at each width

For each page and width: whether the page scrolls sideways, each table wider than its column (the theme lets
such a table scroll inside its box, which a reader must notice), and each image that did not load or is wider
than the window. The site is built from docs/ into a temporary directory (`mkdocs build`); a small script
added to each page measures the laid-out page and leaves its findings in the DOM Chromium prints.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTHS = {"desktop": 1280, "phone": 412}
_MEASURE = """<script>
window.addEventListener("load", () => {
  const found = {sideways: document.documentElement.scrollWidth > document.documentElement.clientWidth + 1,
                 tables: [], images: []};
  document.querySelectorAll(".document table, .rst-content table").forEach((table) => {
    const room = table.parentElement.clientWidth;
    if (table.scrollWidth > room + 1) {
      const head = table.querySelector("th, td");
      found.tables.push({first_cell: head ? head.textContent.trim().slice(0, 40) : "", width: table.scrollWidth, room});
    }
  });
  document.querySelectorAll("img").forEach((image) => {
    if (!image.complete || image.naturalWidth === 0) found.images.push("not loaded: " + image.getAttribute("src"));
    else if (image.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
      found.images.push("wider than the window: " + image.getAttribute("src"));
  });
  document.body.setAttribute("data-look", JSON.stringify(found));
});
</script>"""
_LOOK = re.compile(r'data-look="([^"]*)"')


def _chromium(*arguments: str) -> str:
    with tempfile.TemporaryDirectory() as profile:  # a profile each: a second browser must not hand its page to the first
        command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   f"--user-data-dir={profile}", "--run-all-compositor-stages-before-draw", "--virtual-time-budget=3000",
                   *arguments]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def look(site: str, page: str, width: int) -> dict:
    """What Chromium found on `page` (a path under `site`) at `width` pixels."""
    dom = _chromium(f"--window-size={width},900", "--dump-dom", f"file://{os.path.join(site, page)}")
    match = _LOOK.search(dom)
    if match is None:
        raise RuntimeError(f"{page}: the page's measuring script left nothing (did it load?)")
    return json.loads(match[1].replace("&quot;", '"').replace("&amp;", "&"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screenshots", help="a directory for a PNG of each page's first screen at each width")
    args = parser.parse_args()
    if shutil.which("chromium") is None:
        sys.exit("site_look: needs Debian's chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as site:
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", site], cwd=ROOT, check=True)
        pages = sorted(os.path.relpath(p, site) for p in glob.glob(os.path.join(site, "**", "index.html"),
                                                                     recursive=True) if "/search/" not in p)
        for page in pages:
            path = os.path.join(site, page)
            with open(path) as f:
                html = f.read()
            with open(path, "w") as f:
                f.write(html.replace("</body>", _MEASURE + "</body>"))
        problems = 0
        for page in pages:
            for name, width in WIDTHS.items():
                found = look(site, page, width)
                lines = (["the page scrolls sideways"] if found["sideways"] else []) + [
                    f"table '{t['first_cell']}' is {t['width']} px in {t['room']} px" for t in found["tables"]
                ] + found["images"]
                problems += len(lines)
                for line in lines:
                    print(f"{page} ({name}, {width} px): {line}")
                if args.screenshots:
                    os.makedirs(args.screenshots, exist_ok=True)
                    shot = os.path.join(args.screenshots, page.replace("/", "_").replace("index.html", "")
                                        + f"{name}.png")
                    _chromium(f"--window-size={width},900", f"--screenshot={os.path.abspath(shot)}",
                              f"file://{os.path.join(site, page)}")
        print(f"{len(pages)} pages at {len(WIDTHS)} widths: {problems} finding(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
