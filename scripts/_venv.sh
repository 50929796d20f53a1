# Sourced by scripts/serve and scripts/test: creates .venv on first use and installs the project
# (with the extras named in KEEL_EXTRAS) again only when pyproject.toml has changed since. It sets
# $root to the repository and puts .venv first on PATH; it leaves the working directory alone.
# The Python it makes .venv with is python3, or the one PYTHON names (3.11 or newer).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2> /dev/null; }
# A .venv made by a Python too old for Keel (or left without its interpreter by an upgrade) is made again.
if [ -d "$venv" ] && ! new_enough "$venv/bin/python"; then
    rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
    if ! command -v "$python" > /dev/null; then
        echo "$(basename "$0"): Keel needs Python 3.11 or newer, and there is no $python here: install one, and name it with PYTHON if it is not $python (PYTHON=python3.12 $0)" >&2
        exit 1
    fi
    if ! new_enough "$python"; then
        found=$("$python" -c 'import platform; print(platform.python_version())' 2> /dev/null || echo "of unknown version")
        echo "$(basename "$0"): Keel needs Python 3.11 or newer, and $python is $found: install a newer one, and name it with PYTHON (PYTHON=python3.12 $0)" >&2
        exit 1
    fi
    "$python" -m venv "$venv"
fi
extras=${KEEL_EXTRAS:-}
hash=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
stamp="$venv/.keel-installed-${extras:-base}"
# An install with extras also satisfies a plain one.
if ! grep -qsx "$hash" "$stamp" && { [ -n "$extras" ] || ! grep -qsx "$hash" "$venv"/.keel-installed-*; }; then
    spec="$root"
    [ -n "$extras" ] && spec="$root[$extras]"
    echo "installing Keel${extras:+ with its $extras extra} into .venv (once; a minute or so)..." >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$spec"
    echo "$hash" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
