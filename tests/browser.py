"""A headless Chromium for browser tests, driven over the DevTools protocol with aiohttp's WebSocket
client (no extra package): navigate, evaluate JavaScript, dispatch mouse events, take a screenshot.

Chromium comes from the system (Debian's ``chromium``; ``.ci/run`` installs it). Without one the
browser tests skip, unless ``PAGEDSERVE_REQUIRE_BROWSER=1`` (set by CI), where they fail.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str:
    found = os.environ.get("CHROMIUM") or next(filter(None, map(shutil.which, NAMES)), None)
    if found is None:
        if os.environ.get("PAGEDSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail("no Chromium on PATH (apt-get install chromium), and PAGEDSERVE_REQUIRE_BROWSER=1")
        pytest.skip("no Chromium on PATH (apt-get install chromium)")
    return found


class Browser:
    """``async with Browser(profile_dir) as page:`` one headless tab."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1600) -> None:
        self.args = [find_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                     "--disable-dev-shm-usage", f"--window-size={width},{height}", "--remote-debugging-port=0",
                     f"--user-data-dir={profile}", "about:blank"]
        self._ids = itertools.count(1)

    async def __aenter__(self) -> "Browser":
        self.process = await asyncio.create_subprocess_exec(*self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        port = None
        async with asyncio.timeout(30):
            while port is None:
                line = (await self.process.stderr.readline()).decode()
                if not line:
                    raise RuntimeError("chromium exited before it listened for DevTools")
                if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                    port = int(m.group(1))
        self._drain = asyncio.create_task(self._drain_stderr())
        self.http = aiohttp.ClientSession()
        async with self.http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            page = next(t for t in await resp.json() if t["type"] == "page")
        self.ws = await self.http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.call("Page.enable")
        await self.call("Runtime.enable")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ws.close()
        await self.http.close()
        self.process.kill()
        await self.process.wait()
        self._drain.cancel()

    async def _drain_stderr(self) -> None:
        while await self.process.stderr.readline():
            pass

    async def call(self, method: str, **params) -> dict:
        """One DevTools command; its result (events in between are skipped)."""
        msg_id = next(self._ids)
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        async with asyncio.timeout(30):
            while True:
                reply = json.loads((await self.ws.receive()).data)
                if reply.get("id") == msg_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def js(self, expression: str):
        """The value of a JavaScript expression (awaited when it is a promise)."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str):
        """Poll ``expression`` until it is truthy; its value. One that throws (the page is still
        loading) counts as not yet."""
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return null; }} }})()"
        try:
            async with asyncio.timeout(timeout):
                while not (value := await self.js(guarded)):
                    await asyncio.sleep(0.2)
                return value
        except TimeoutError:
            raise AssertionError(f"the page never showed {what} within {timeout} s") from None

    async def mouse(self, kind: str, x: float, y: float) -> None:
        await self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y)

    async def screenshot(self, path: Path) -> int:
        """A PNG of the window (as the user sees it, hovering included); its size in bytes."""
        data = base64.b64decode((await self.call("Page.captureScreenshot", format="png"))["data"])
        path.write_bytes(data)
        return len(data)
