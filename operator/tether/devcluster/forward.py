"""A TCP forwarder: `python -m tether.devcluster.forward LISTEN_HOST:PORT TARGET_HOST:PORT`.

The local API server listens on loopback only; the real node lives in a network namespace of its
own and reaches the API server through this forwarder on the host side of its veth pair. Bytes
pass through untouched (TLS ends at the API server).
"""

from __future__ import annotations

import argparse
import asyncio


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, upstream_w), pipe(upstream_r, client_w))

    server = await asyncio.start_server(handle, *listen)
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("listen", type=_address)
    parser.add_argument("target", type=_address)
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.target))


if __name__ == "__main__":
    main()
