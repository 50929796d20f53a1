# Sourced by scripts/serve and scripts/test: creates or refreshes .venv, installs
# the project (and the extras named in KEEL_EXTRAS) only when pyproject.toml changed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
extras=${KEEL_EXTRAS:-}
stamp="$venv/.keel-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1) [$extras]"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    spec="$root"
    [ -n "$extras" ] && spec="$root[$extras]"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$spec"
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
