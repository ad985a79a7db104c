"""The KV dashboard in a real headless Chromium: the page asks for the API key, connects, and draws
the live pool (owned and shared cells), the figures, the charts and the request table from the
real stack under load; hovering a shared cell names its holders; a selected request's block table
marks its shared blocks. A screenshot is saved (``PAGEDSERVE_SCREENSHOT=path`` copies it there:
``docs/images/dashboard.png`` is made this way)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil

import aiohttp

from tests.browser import Browser, find_chromium
from tests.gateway.dashboard_feed import hold_load

KEY = "browser-key"
SCREENSHOT_HISTORY_S = 45
CHARTS = ("chart-throughput", "chart-kv", "chart-ttft", "chart-itl", "chart-queue")
GRID_COLOURS = """(() => {
  const c = document.querySelector('.worker canvas.gpu');
  if (!c || !c.width) return null;
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, seen = {};
  for (let i = 0; i < d.length; i += 4) { const k = d[i] + ',' + d[i + 1] + ',' + d[i + 2]; seen[k] = (seen[k] || 0) + 1; }
  return seen;
})()"""
OWNED, SHARED_BY_2, SHARED_BY_3 = "65,171,93", "253,174,107", "253,141,60"
LIVE = f"""(() => {{
  const grid = {GRID_COLOURS};
  const charts = {list(CHARTS)}.map((id) => document.getElementById(id).dataset);
  return grid && grid['{OWNED}'] && grid['{SHARED_BY_3}'] && charts.every((d) => +d.points > 0)
    && +charts[0].max > 0 && +charts[1].max > 0 && +charts[2].max > 0 && +charts[3].max > 0;
}})()"""
SHARED_CELL = """(() => {
  const w = [...dashboard.workers.values()][0], c = w.view.gpu;
  const i = w.gpu.cells.findIndex((v) => v >= 4);
  if (i < 0) return null;
  c.scrollIntoView({ block: "nearest" });
  const r = c.getBoundingClientRect(), size = +c.dataset.cellSize, cols = +c.dataset.cols;
  return [r.left + (i % cols) * size + size / 2, r.top + Math.floor(i / cols) * size + size / 2];
})()"""
FORK_ROW = """(() => {
  const row = [...document.querySelectorAll('#requests tbody tr')].find((tr) => tr.children[3].textContent === '3');
  if (!row) return false;
  row.click();
  return true;
})()"""


def test_the_dashboard_draws_the_live_pool_figures_charts_and_requests(stack, tmp_path):
    find_chromium()
    keyed = stack.add_gateway(api_keys=(KEY,))

    async def go():
        async with aiohttp.ClientSession() as http, Browser(tmp_path / "profile", height=1650) as page:
            load = asyncio.create_task(hold_load(http, keyed, headers={"Authorization": f"Bearer {KEY}"}))
            try:
                await page.goto(keyed + "/dashboard")
                await page.wait_for("!document.getElementById('key-form').hidden", 20, "the API key form")
                await page.js(f"document.getElementById('key').value = '{KEY}'; document.querySelector('#key-form button').click()")
                await page.wait_for(LIVE, 60, "a grid with owned and shared cells and every chart with data")
                figures = dict(await page.js("[...document.querySelectorAll('.figures dd')].map((d) => [d.dataset.figure, d.textContent])"))
                assert float(figures["utilisation"].split()[0]) > 0
                assert float(figures["saved by sharing"].split()[0]) > 0
                assert float(figures["tokens/s"]) > 0
                bars = dict(await page.js("[...document.querySelectorAll('.paging .bar')].map((b) => "
                                          "[b.dataset.figure, +b.textContent.split(': ')[1]])"))
                assert bars["without paging"] >= bars["paged"] > bars["paged and shared"] > 0, bars

                x, y = await page.wait_for(SHARED_CELL, 20, "a block shared by three sequences")
                await page.mouse("mouseMoved", x, y)
                tip = await page.wait_for("!tooltip.hidden && tooltip.textContent", 5, "the tooltip")
                assert "refcount 3" in tip and "held by" in tip and "#2" in tip, tip

                await page.wait_for(FORK_ROW, 20, "the three-sample request in the table")
                blocks = await page.wait_for("document.querySelectorAll('#block-table .seq').length === 3 && "
                                             "document.querySelectorAll('#block-table .blk.shared').length", 10,
                                             "the selected request's block tables")
                assert blocks >= 3  # the prompt's block, in each of the three tables
                if os.environ.get("PAGEDSERVE_SCREENSHOT"):  # for the docs: charts with some history
                    await asyncio.sleep(SCREENSHOT_HISTORY_S)
                    await page.wait_for(FORK_ROW, 20, "the three-sample request in the table")
                    x, y = await page.wait_for(SHARED_CELL, 20, "a block shared by three sequences")
                await page.mouse("mouseMoved", x, y)
                await asyncio.sleep(0.3)
                assert await page.screenshot(tmp_path / "dashboard.png") > 20_000
            finally:
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await load

    asyncio.run(go())
    if os.environ.get("PAGEDSERVE_SCREENSHOT"):
        shutil.copy(tmp_path / "dashboard.png", os.environ["PAGEDSERVE_SCREENSHOT"])


def test_the_api_docs_page_renders_with_nothing_but_the_gateway(stack, tmp_path):
    """``/docs`` in Chromium on a machine with no network (as here): Swagger UI, from the gateway's
    own files, reads ``/openapi.json`` and lists the routes."""
    find_chromium()

    async def go():
        async with Browser(tmp_path / "profile") as page:
            await page.goto(stack.url + "/docs")
            title = await page.wait_for("document.querySelector('.swagger-ui .info .title')?.textContent", 30,
                                        "Swagger UI's title, read from /openapi.json")
            paths = await page.wait_for("[...document.querySelectorAll('.opblock-summary-path')].map((e) => e.textContent)"
                                        ".join(' ') || null", 10, "the operations")
            return title, paths

    title, paths = asyncio.run(go())
    assert "pagedserve" in title and "/v1/chat/completions" in paths
