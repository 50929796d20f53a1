# Sourced by scripts/serve and scripts/test: creates .venv on first use and installs the project
# (with the extras named in KEEL_EXTRAS) again only when pyproject.toml has changed since. It sets
# $root to the repository and puts .venv first on PATH; it leaves the working directory alone.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
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
