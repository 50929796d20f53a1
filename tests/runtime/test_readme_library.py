"""The README's program that uses the loop from Python, run as written: taken from README.md,
run in subprocesses in a directory of its own against the fake model server on loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import trio
from fake_model import FakeModel, Reply, calling

from persistence.transcript import Message
from runtime.agent import STEER_LABEL
from tests.runtime.agent_support import stored_messages

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 30.0  # three interpreters start, one after the other
SECTION = "## Using the loop from Python"


def readme_program() -> str:
    """The one Python block of the README's section on using the loop from Python."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, f"the section should hold one Python program, not {len(blocks)}"
    return str(blocks[0])


async def test_the_readmes_program_steers_asks_and_resumes_as_it_says(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake: FakeModel = await nursery.start(FakeModel(respond=calling("clock", Reply(text="Il est midi."))).serve)
    (tmp_path / "chat.py").write_text(readme_program(), encoding="utf-8")
    # Keel from this tree, as an installed package is found from any directory: the working directory is not the repository.
    env = {**os.environ, "MODEL_URL": fake.base_url, "PYTHONPATH": str(ROOT)}

    async def chat(*args: str) -> str:
        done = await trio.run_process(
            [sys.executable, "chat.py", *args], cwd=tmp_path, env=env, capture_stdout=True, capture_stderr=True, check=False
        )
        assert done.returncode == 0, done.stderr.decode()
        return str(done.stdout.decode())

    with trio.fail_after(DEADLINE_S):
        assert await chat("steer", "In French, please.") == ""  # no run works: it waits for the next one
        asked = await chat("ask", "What time is it?")
        resumed = await chat("resume")
    lines = asked.splitlines()
    assert lines[0] == "[steered: In French, please.]"
    assert re.fullmatch(r"\[clock: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00\]", lines[1])
    assert lines[2:] == ["Il est midi.", "'Il est midi.' after 2 model calls"]
    assert resumed == "\n'Il est midi.' after 2 model calls\n"  # the turn's, made before: the model is not asked again
    assert len(fake.bodies) == 2
    sent = fake.bodies[0]["messages"]
    assert sent[0] == {"role": "system", "content": "Answer briefly."}
    assert sent[1]["content"] == f"What time is it?\n\n{STEER_LABEL}In French, please."
    stored = await stored_messages(tmp_path / "chat.db", "demo")
    assert [message.role for message in stored] == ["user", "user", "assistant", "tool", "assistant"]
    assert stored[-1] == Message(role="assistant", text="Il est midi.")
