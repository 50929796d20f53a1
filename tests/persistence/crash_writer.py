"""Child process for the crash test: appends forever and acknowledges each durable append.

Usage: python crash_writer.py DB_PATH. Prints "k i" once the append of writer k's i-th event
has returned (so it is durable), until it is killed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio

from persistence.sessions import open_session_store

WRITERS = 16
PADDING = "x" * 200


def content(k: int, i: int) -> str:
    return json.dumps({"k": k, "i": i, "pad": PADDING})


async def main(path: Path) -> None:
    async with open_session_store(path) as store:

        async def writer(k: int) -> None:
            i = 0
            while True:
                await store.append(f"session-{k % 4}", [content(k, i)])
                sys.stdout.write(f"{k} {i}\n")
                sys.stdout.flush()
                i += 1

        async with trio.open_nursery() as nursery:
            for k in range(WRITERS):
                nursery.start_soon(writer, k)


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]))
