"""Size and speed of the HTML report (not a test: prints a table).

For random attention maps of T tokens x 6 layers x 12 heads it measures, in one run:
the file size, and beside it the size of the same weights written as JSON numbers with 4
decimals (how notebook attention viewers usually embed them); the time Python takes to
write the file; and, in headless Chromium (Debian's /usr/bin/chromium driven by
Playwright), the time from opening the file to the first drawing, and the time each view
switch takes until the next painted frame.

    .venv/bin/python benchmarks/report.py [--tokens 64 128 256] [--layers 6] [--heads 12]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attnlab.viz import html_report as rep  # noqa: E402
from report_data import random_explanation  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# time from an action in the page to the second animation frame after it (layout + paint)
FRAME = """async ([sel, value]) => {
  const t = performance.now();
  const el = document.querySelector(sel);
  if (value === null) el.dispatchEvent(new MouseEvent("click", {bubbles: true}));
  else if (value === "hover") el.dispatchEvent(new MouseEvent("mouseover", {bubbles: true}));
  else { el.value = value; el.dispatchEvent(new Event("change")); }
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  return performance.now() - t;
}"""

ACTIONS = [
    ("model view", '.al-tab[data-view="model"]', None),
    ("open thumbnail", '.al-thumb[data-layer="3"][data-head="5"]', None),
    ("heatmap view", '.al-tab[data-view="heatmap"]', None),
    ("embedding view", '.al-tab[data-view="embedding"]', None),
    ("head view (all heads)", '.al-tab[data-view="head"]', None),
    ("all heads", ".al-all", None),
    ("layer switch", ".al-layer", "5"),
    ("toggle head", '.al-chip[data-head="0"]', None),
    ("hover token", '.al-tok[data-side="0"][data-idx="7"]', "hover"),
]


def browser_times(path: Path, page) -> dict[str, float]:
    t0 = time.perf_counter()
    page.goto(path.resolve().as_uri())
    page.wait_for_selector(".attnlab-report[data-ready='1']", timeout=60_000)
    out = {"open to ready": (time.perf_counter() - t0) * 1000}
    out["script"] = float(page.get_attribute(".attnlab-report", "data-render-ms"))
    for name, sel, value in ACTIONS:
        out[name] = page.evaluate(FRAME, [sel, value])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--sharpness", type=float, nargs="+", default=[1.0, 3.0],
                    help="std of the random logits: 1 = flat maps (compress worst), 3 = peaky")
    args = ap.parse_args()

    pw = None
    if Path(CHROMIUM).exists():
        try:
            from playwright.sync_api import sync_playwright

            pw = sync_playwright().start()
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
        except ImportError:
            pw = None
    if pw is None:
        print("(no Chromium/Playwright: sizes only)")

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for T in args.tokens:
            for sharp in args.sharpness:
                e = random_explanation(T, args.layers, args.heads, dim=64, sharpness=sharp)
                t = time.perf_counter()
                path = rep.write_report(e, Path(d) / f"r{T}.html")
                write_ms = (time.perf_counter() - t) * 1000
                size = path.stat().st_size
                naive = len(json.dumps(np.round(e.attentions, 4).tolist()))
                row = {"T": T, "sharp": sharp, "MiB": size / 2**20, "JSON MiB": naive / 2**20,
                       "ratio": naive / size, "write ms": write_ms}
                if pw is not None:
                    row.update(browser_times(path, page))
                rows.append(row)
    if pw is not None:
        browser.close()
        pw.stop()

    shape = f"{args.layers} layers x {args.heads} heads"
    print(f"HTML report, random maps of T tokens x {shape}; "
          "times in ms (browser: to the 2nd frame)")
    cols = list(rows[0])
    width = {c: max(len(c), 7) for c in cols}
    print("  ".join(c.rjust(width[c]) for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            if isinstance(v, int):
                s = str(v)
            elif c in ("MiB", "JSON MiB", "ratio"):
                s = f"{v:.2f}"
            else:
                s = f"{v:g}" if c == "sharp" else f"{v:.0f}"
            cells.append(s.rjust(width[c]))
        print("  ".join(cells))
    print("ratio = size of the weights alone as 4-decimal JSON / size of the whole report file")


if __name__ == "__main__":
    main()
