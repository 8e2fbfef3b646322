#!/usr/bin/python3
"""dtrain-report's test (CTest: report_test). Builds reports from fake run directories
(report_fixture.py), loads each in headless Chromium from a file:// URL with the network unreachable, and
checks: no console message and no error recorded by the page; each chart drew the number of points the
fixture holds; the charts drawn and the notes about absent parts; a screenshot that is not blank. A page
with a planted script error must be caught by the same checks. Also: the errors dtrain-report gives for
a missing run directory, a missing metrics file and malformed lines, and a trace of tens of MB.

  report_test.py BIN_DIR            (BIN_DIR holds dtrain-report; Chromium from PATH, or $CHROMIUM)
  report_test.py BIN_DIR --milnce   a real 2-rank milnce run (3 short epochs) with DTRAIN_TIMELINE, merged
                                    by dtrain-trace: its report, checked against its metrics.jsonl and trace
"""
import html.parser
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "report_fixture.py")
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import report_fixture  # noqa: E402
TIMEOUT = 90  # seconds, per command
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, **kw)


def fixture(kind, d):
    p = run([sys.executable, FIXTURE, kind, d])
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


class Dom(html.parser.HTMLParser):
    """The attributes of every element with an id, and the text of #notes and #report-errors."""

    def __init__(self, text):
        super().__init__()
        self.by_id, self.stack, self.texts = {}, [], {"notes": [], "report-errors": [], "title": []}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.by_id[a["id"]] = a
        if tag not in ("br", "meta", "img", "input", "hr", "link"):
            self.stack.append(a.get("id"))

    def handle_endtag(self, tag):
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        for i in self.stack:
            if i in self.texts:
                self.texts[i].append(data)


def chromium(args, url, profile):
    exe = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        raise SystemExit("report_test: chromium not found (scripts/setup.sh installs Debian's chromium)")
    # No network: every name resolves to nothing and every proxied fetch fails, so a page that needs
    # the network at view time shows a console error.
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
           f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--proxy-server=http://127.0.0.1:9", "--no-first-run"] + args + [url]
    return run(cmd)


def load(page, profile):
    """(Dom, console lines) of `page` as Chromium renders it."""
    p = chromium(["--dump-dom"], "file://" + os.path.abspath(page), profile)
    console = [l for l in p.stderr.splitlines() if ":CONSOLE" in l]
    return Dom(p.stdout), console


def png_pixels(path):
    """(width, height, rows of pixel tuples) of an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    prev, rows = bytearray(stride), []
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif f == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev))
        elif f == 3:
            for i in range(stride):
                line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 255
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows


def screenshot_ok(page, profile, tmp):
    shot = os.path.join(tmp, "shot.png")
    p = chromium([f"--screenshot={shot}", "--window-size=1400,2000"], "file://" + os.path.abspath(page), profile)
    check(os.path.exists(shot), f"screenshot written ({p.returncode})")
    if not os.path.exists(shot):
        return
    w, h, bpp, rows = png_pixels(shot)
    colours, counts = set(), {}
    for r in rows[::4]:
        for x in range(0, w * bpp, 4 * bpp):
            px = r[x:x + 3]
            colours.add(px)
            counts[px] = counts.get(px, 0) + 1
    total = sum(counts.values())
    background = max(counts.values()) / total
    check(len(colours) >= 30, f"screenshot {w}x{h} has {len(colours)} distinct colours (at least 30)")
    check(background <= 0.9, f"screenshot: {100 * (1 - background):.0f}% of pixels differ from the background colour (at least 10%)")


def check_page(name, page, expect, profile):
    dom, console = load(page, profile)
    status = dom.by_id.get("report-status", {})
    check(status.get("data-rendered") == "1", f"{name}: page rendered (data-rendered={status.get('data-rendered')})")
    check(status.get("data-errors") == "0" and not "".join(dom.texts["report-errors"]).strip(),
          f"{name}: no error recorded by the page: {''.join(dom.texts['report-errors'])[:300]}")
    check(not console, f"{name}: no console message in Chromium's log: {console[:3]}")
    drawn = sorted((status.get("data-charts") or "").split())
    check(drawn == sorted(expect["charts"]), f"{name}: charts drawn {drawn} == {sorted(expect['charts'])}")
    for chart, series in expect["charts"].items():
        box = dom.by_id.get("chart-" + chart, {})
        if "*" in series:
            want_total = series["*"]
        else:
            want = " ".join(f"{k}:{v}" for k, v in series.items())
            check(box.get("data-series") == want, f"{name}: {chart} series {box.get('data-series')} == {want}")
            want_total = sum(series.values())
        check(box.get("data-points") == str(want_total), f"{name}: {chart} points {box.get('data-points')} == {want_total}")
    if expect["timeline_rows"]:
        rows = dom.by_id.get("chart-timeline", {}).get("data-rows")
        check(rows == str(expect["timeline_rows"]), f"{name}: timeline rows {rows} == {expect['timeline_rows']}")
    notes = " | ".join(dom.texts["notes"])
    for a in expect["absent"]:
        check(a in notes, f"{name}: the page notes '{a}'")
    for t in expect["texts"]:
        check(t in notes + "".join(dom.texts["title"]), f"{name}: the page shows '{t}'")
    return dom, console


def report(bin_dir, run_dir, *extra):
    return run([os.path.join(bin_dir, "dtrain-report"), run_dir] + list(extra))


def errors(bin_dir, tmp):
    p = report(bin_dir, os.path.join(tmp, "nowhere"))
    check(p.returncode == 1 and "nowhere: no such run directory" in p.stderr, f"missing RUN_DIR: {p.stderr.strip()}")
    p = report(bin_dir, os.path.join(tmp, "full"), "-o", os.path.join(tmp, "no", "dir", "r.html"))
    check(p.returncode == 1 and "no/dir/r.html: cannot write the report" in p.stderr, f"output directory missing: {p.stderr.strip()}")
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty)
    p = report(bin_dir, empty)
    check(p.returncode == 1 and "empty/metrics.jsonl: no such file" in p.stderr, f"missing metrics: {p.stderr.strip()}")
    for lines, what in [(['{"kind":"step","step":1}', '{"kind":"step","step":2}', '{oops', '{"kind":"step","step":4}'],
                         "metrics.jsonl:3: not valid JSON"),
                        (['{"kind":"step","step":1}', '{"kind":"step","step":2,"loss":"high"}'],
                         'metrics.jsonl:2: field "loss" is "high"'),
                        (['{"kind":"step","step":1}', '{"step":2}'], 'metrics.jsonl:2: record without a string "kind"'),
                        (['{"kind":"eval","R@1":3}'], "metrics.jsonl:1: eval record without")]:
        d = tempfile.mkdtemp(dir=tmp)
        open(os.path.join(d, "metrics.jsonl"), "w").write("\n".join(lines) + "\n")
        p = report(bin_dir, d)
        check(p.returncode == 1 and what in p.stderr and not os.path.exists(os.path.join(d, "report.html")),
              f"malformed metrics ({what}): {p.stderr.strip()}")
    # A run still writing: the incomplete last line is skipped with a warning; a bad trace drops the timeline.
    d = tempfile.mkdtemp(dir=tmp)
    open(os.path.join(d, "metrics.jsonl"), "w").write('{"kind":"step","step":1,"loss":2}\n{"kind":"step","st')
    os.makedirs(os.path.join(d, "timeline"))
    open(os.path.join(d, "timeline", "trace.json"), "w").write('{"traceEvents": [{"ph": "X", ')
    p = report(bin_dir, d)
    check(p.returncode == 0 and "metrics.jsonl:2: incomplete last line skipped" in p.stderr
          and "trace.json: not a valid Chrome trace" in p.stderr, f"partial last line, bad trace: {p.stderr.strip()}")
    return d


def appended_runs(bin_dir, tmp):
    """Runs appended to one metrics file: a resumed run replaces the redone steps, a fresh one all."""
    d = tempfile.mkdtemp(dir=tmp)
    run = lambda lr: json.dumps({"kind": "run", "app": "milnce", "world_size": 2, "config": {"lr": lr}})
    step = lambda i: json.dumps({"kind": "step", "step": i, "loss": 1.0 / i})
    lines = [run(1), *map(step, range(1, 11)), run(2), *map(step, range(8, 16))]
    open(os.path.join(d, "metrics.jsonl"), "w").write("\n".join(lines) + "\n")
    p = report(bin_dir, d)
    check(p.returncode == 0 and ": 15 steps," in p.stdout and
          "metrics.jsonl:12: a run resumed at step 8: 3 step record(s)" in p.stderr,
          f"a resumed run: steps 1-7 of the first run and 8-15 of the second: {p.stdout.strip()} {p.stderr.strip()}")
    lines += [run(3), *map(step, range(1, 6))]
    open(os.path.join(d, "metrics.jsonl"), "w").write("\n".join(lines) + "\n")
    p = report(bin_dir, d)
    check(p.returncode == 0 and ": 5 steps," in p.stdout and "metrics.jsonl:21: a run started afresh at step 1" in p.stderr,
          f"a run started afresh: its 5 steps only: {p.stdout.strip()} {p.stderr.strip()}")


def big_trace(bin_dir, tmp):
    """A trace of tens of MB: the page embeds only the window (or --max-events of it)."""
    d = os.path.join(tmp, "big")
    fixture("full", d)
    tr = report_fixture.trace(steps=4000, ranks=4)
    with open(os.path.join(d, "timeline", "trace.json"), "w") as f:
        json.dump(tr, f)
    mb = os.path.getsize(os.path.join(d, "timeline", "trace.json")) / 1e6
    want = report_fixture.expected_timeline(tr)
    t0 = time.time()
    p = report(bin_dir, d)
    took = time.time() - t0
    check(p.returncode == 0 and f"timeline of {want['points']} of " in p.stdout,
          f"{mb:.0f} MB trace: {want['points']} events shown, in {took:.1f} s: {p.stdout.strip()} {p.stderr.strip()}")
    size = os.path.getsize(os.path.join(d, "report.html")) / 1e6
    check(size < 1.0, f"{mb:.0f} MB trace: page of {size:.2f} MB")
    p = report(bin_dir, d, "--max-events", "20", "-o", os.path.join(d, "capped.html"))
    check(p.returncode == 0 and "timeline of 20 of " in p.stdout, f"--max-events 20: {p.stdout.strip()}")
    # Too few forward passes: the backward ones; too few of either: a window of --window-ms from the 3rd
    # (or last) one, or from the start.
    for what, tr, how in [("4 steps", report_fixture.trace(steps=4), "too few forward events on rank 0 (4)"),
                          ("3 steps, to the end", report_fixture.trace(steps=3), "5000 ms at most from forward 3"),
                          ("2 steps", report_fixture.trace(steps=2), "50 ms at most from forward 2"),
                          ("no forward", json.loads(json.dumps(report_fixture.trace(steps=8)).replace('"forward"', '"fwd"')),
                           "steps 3 to 5 of rank 0 (from the start of its backward 3 to that of backward 6)"),
                          ("neither", json.loads(json.dumps(report_fixture.trace(steps=3)).replace('"forward"', '"fwd"')
                                                 .replace('"backward"', '"bwd"')),
                           "no forward or backward on rank 0 in the trace")]:
        with open(os.path.join(d, "timeline", "trace.json"), "w") as f:
            json.dump(tr, f)
        ms = 5000 if "to the end" in what else 50
        want = report_fixture.expected_timeline(tr, window_ms=ms)
        p = report(bin_dir, d, "--window-ms", str(ms), "-o", os.path.join(d, "short.html"))
        page = open(os.path.join(d, "short.html")).read()
        data = json.loads(page.split('id="report-data">')[1].split("</script>")[0])
        length = data["timeline"]["window"]["length_ms"]
        check(p.returncode == 0 and f"timeline of {want['points']} of " in p.stdout and how in page
              and abs(length - want["length_ms"]) < 1e-6,
              f"{what}: {want['points']} events shown in {length} ms ({want['length_ms']}), '{how}': {p.stdout.strip()}")
    return os.path.join(d, "capped.html")


def expected_from_run(run_dir):
    """What the page of a real run must show, from its metrics.jsonl and trace.json (as the page's script
    and report_fixture.expected_timeline pick them)."""
    records = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    count = report_fixture.count
    n = lambda key: count(steps, key)
    charts = {}
    if n("loss") or n("lr"):
        charts["loss"] = {k: n(k) for k in ("loss", "lr") if n(k)}
    for chart, key in [("throughput", "samples_per_s"), ("bytes", "bytes_sent"), ("memory", "rss_bytes"),
                       ("bubble", "bubble_fraction")]:
        if n(key):
            charts[chart] = {key: n(key)}
    if n("compute_s") or n("exposed_comm_s"):
        charts["comm"] = {"compute_s": n("compute_s"), "exposed_comm_s": n("exposed_comm_s")}
    if evals:
        charts["retrieval"] = {k: count(evals, k) for k in ("R@1", "R@5", "R@10", "median_rank") if count(evals, k)}
    tl = report_fixture.expected_timeline(json.load(open(os.path.join(run_dir, "timeline", "trace.json"))))
    charts["timeline"] = {"*": min(tl["points"], 4000)}
    return {"charts": charts, "timeline_rows": tl["rows"], "absent": [], "texts": ["milnce"]}, len(steps), len(evals)


def milnce(bin_dir, tmp, profile):
    """A real 2-rank milnce run with the timeline on: its report, checked like the fixtures'."""
    data, run_dir = os.path.join(tmp, "data"), os.path.join(tmp, "run")
    p = run([os.path.join(bin_dir, "milnce"), "gen-data", "--out", data, "--videos", "48", "--eval-videos", "24",
             "--progress", "off"])
    check(p.returncode == 0, f"milnce gen-data: {p.stderr.strip()[-300:]}")
    env = dict(os.environ, DTRAIN_TIMELINE=os.path.join(run_dir, "timeline"))
    p = run([os.path.join(bin_dir, "dtrain-run"), "--standalone", "--nproc-per-node", "2", os.path.join(bin_dir, "milnce"),
             "train", "--data", data, "--out", run_dir, "--epochs", "3", "--batch", "8", "--progress", "off"], env=env)
    check(p.returncode == 0, f"milnce train under dtrain-run with DTRAIN_TIMELINE: {p.stdout.strip()[-300:]} {p.stderr.strip()[-300:]}")
    p = run([os.path.join(bin_dir, "dtrain-trace"), "merge", os.path.join(run_dir, "timeline")])
    check(p.returncode == 0, f"dtrain-trace merge: {p.stdout.strip()[-200:]} {p.stderr.strip()[-300:]}")
    p = report(bin_dir, run_dir)
    check(p.returncode == 0 and "absent" not in p.stdout, f"dtrain-report on the run: {p.stdout.strip()} {p.stderr.strip()}")
    expect, steps, evals = expected_from_run(run_dir)
    check(steps > 0 and evals > 0 and set(expect["charts"]) >= {"loss", "throughput", "comm", "bytes", "retrieval", "timeline"},
          f"the run logged {steps} steps and {evals} evals; charts {sorted(expect['charts'])}")
    check_page("milnce", os.path.join(run_dir, "report.html"), expect, profile)


def main():
    bin_dir = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "--milnce":
        tmp = tempfile.mkdtemp(prefix="report_milnce_test.")
        try:
            milnce(bin_dir, tmp, os.path.join(tmp, "chromium-profile"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"report_test --milnce: {len(failures)} check(s) failed" if failures else "report_test --milnce: all checks pass")
        return 1 if failures else 0
    tmp = tempfile.mkdtemp(prefix="report_test.")
    profile = os.path.join(tmp, "chromium-profile")
    try:
        full = os.path.join(tmp, "full")
        expect = fixture("full", full)
        p = report(bin_dir, full, "-o", os.path.join(full, "report.html"))
        check(p.returncode == 0, f"dtrain-report on the full fixture: {p.stdout.strip()} {p.stderr.strip()}")
        page = open(os.path.join(full, "report.html")).read()
        check("<script src" not in page and "<link" not in page and "@import" not in page,
              "the page loads no external script or style")
        check_page("full", os.path.join(full, "report.html"), expect, profile)
        screenshot_ok(os.path.join(full, "report.html"), profile, tmp)

        minimal = os.path.join(tmp, "minimal")
        expect = fixture("minimal", minimal)
        p = report(bin_dir, minimal)
        check(p.returncode == 0 and "absent: no eval records" in p.stdout and "absent: no timeline" in p.stdout,
              f"dtrain-report on the minimal fixture says what is absent: {p.stdout.strip()}")
        check_page("minimal", os.path.join(minimal, "report.html"), expect, profile)

        # Hovering a timeline bar shows its name, category and args: activate the first bar's tooltip.
        data = json.loads(page.split('id="report-data">')[1].split("</script>")[0])
        first = next(e for e in data["timeline"]["events"] if e[3] == 0)
        hover = os.path.join(tmp, "hover.html")
        open(hover, "w").write(page.replace("</body>", """<script>
          var c = Chart.getChart(document.querySelector("#chart-timeline canvas"));
          c.tooltip.setActiveElements([{datasetIndex: 0, index: 0}], {x: 0, y: 0});
          c.update();
          document.getElementById("report-status").dataset.tooltip =
            JSON.stringify({title: c.tooltip.title, body: c.tooltip.body});
        </script></body>"""))
        dom, console = load(hover, profile)
        tip = json.loads(dom.by_id.get("report-status", {}).get("data-tooltip") or "{}")
        check(tip.get("title") == [f"{first[4]} ({first[5]})"] and f"at {first[8]:g} ms" in tip["body"][0]["lines"][0] and first[7] and any(first[7] in a for b in tip.get("body", []) for a in b["after"])
              and not console, f"timeline tooltip: {tip} for {first[4:]}")

        # The checks can fail: a planted script error is caught by the page and shows in Chromium's log.
        broken = os.path.join(tmp, "broken.html")
        open(broken, "w").write(page.replace("</body>", "<script>window.noSuchFunction();</script></body>"))
        dom, console = load(broken, profile)
        check(dom.by_id.get("report-status", {}).get("data-errors") == "1"
              and "noSuchFunction" in "".join(dom.texts["report-errors"])
              and any("noSuchFunction" in l for l in console), "a planted script error is detected")

        partial = errors(bin_dir, tmp)
        dom, console = load(os.path.join(partial, "report.html"), profile)
        check("no timeline: " in " ".join(dom.texts["notes"]) and not console,
              "partial run: the page notes why there is no timeline")
        appended_runs(bin_dir, tmp)
        capped = big_trace(bin_dir, tmp)
        dom, console = load(capped, profile)
        check(dom.by_id.get("chart-timeline", {}).get("data-points") == "20" and not console,
              "--max-events 20: the page draws 20 events")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"report_test: {len(failures)} check(s) failed:\n  " + "\n  ".join(failures))
        return 1
    print("report_test: all checks pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
