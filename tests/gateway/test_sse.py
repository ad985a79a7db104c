"""SSE framing, byte for byte: what every OpenAI client parses."""

from pagedserve.gateway.http import sse


def test_a_frame_is_one_data_line_and_a_blank_line():
    assert sse.frame({"a": 1, "b": "é\n"}) == b'data: {"a":1,"b":"\xc3\xa9\\n"}\n\n'
    assert sse.DONE == b"data: [DONE]\n\n"


def test_a_client_gone_mid_stream_ends_it_quietly():
    """A real aiohttp server whose handler keeps writing after its client closed the connection
    (no handler cancellation, so the write itself must notice): the stream ends as "client gone",
    not as an exception aiohttp turns into a 500."""
    import asyncio

    import aiohttp
    from aiohttp import web

    async def go():
        outcome = asyncio.get_running_loop().create_future()

        async def endless(request):
            response = await sse.open_stream(request)

            async def writes():
                while True:
                    await response.write(sse.frame({"tick": 1}))
                    await asyncio.sleep(0.01)

            try:
                returned = await sse.until_client_gone(request, response, writes())
                outcome.set_result((returned is response, request.get(sse.CLIENT_GONE)))
            except BaseException as err:
                outcome.set_result(err)
                raise
            return returned

        app = web.Application()
        app.router.add_get("/feed", endless)
        runner = web.AppRunner(app, handler_cancellation=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/feed") as feed:
                    await feed.content.readuntil(b"\n\n")
            async with asyncio.timeout(10):
                return await outcome
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == (True, True)
