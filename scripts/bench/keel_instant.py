"""Keel's server as ``python -m runtime serve`` runs it (same flags, stores, runner and HTTP
surface), with the in-process zero-latency model of scripts/bench/instant_model.py in place of
an OpenAI-compatible model server: a TEST DOUBLE, for benchmarks that compare Keel's own cost
with a reference server that calls no model at all.

    python scripts/bench/keel_instant.py [--slow-marker TEXT] [serve flags...]

Every request is answered ``ok`` at once; one whose message holds ``--slow-marker`` sends its
first words and then nothing more for a minute (the long task a benchmark cancels).
"""

from __future__ import annotations

import argparse
import sys

from instant_model import InstantModel

from runtime.serve_cli import serve_with


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow-marker", default="[slow]", help="a message holding this starts a long task")
    args, serve_argv = parser.parse_known_args()
    return serve_with(serve_argv, model=InstantModel(text="ok", slow_marker=args.slow_marker))


if __name__ == "__main__":
    sys.exit(main())
