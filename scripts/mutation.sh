#!/usr/bin/env bash
# Mutation testing (docs/testing.md): mutmut, run in a copy of the project laid out as it installs
# (shared/, worker/, gateway/ ... under pagedserve/), so the tests import the mutated copies by the
# names mutmut gives them (pagedserve.gateway.routing.router ...). In the checkout itself the editable
# install maps pagedserve.* onto the original folders and no mutant is ever run.
#
#   scripts/mutation.sh [mutmut run options]    e.g. --max-children 2
#   scripts/mutation.sh results                 (mutmut results, in the same copy)
#
# What is mutated and which tests run: [tool.mutmut] in pyproject.toml. The copy is out/mutation/
# (ignored), made anew each run with its mutants/ removed, so each run starts afresh (mutmut keeps the
# results of a source file it has seen unchanged, even when the tests changed).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$root/out/mutation"
mutmut="$root/.venv/bin/mutmut"
[ -x "$mutmut" ] || mutmut="$(command -v mutmut)" || { echo "mutmut is not installed: pip install mutmut" >&2; exit 2; }
if [ "${1:-}" = "results" ]; then
    cd "$tree" && exec "$mutmut" "$@"
fi
rm -rf "$tree/pagedserve" "$tree/tests" "$tree/mutants"  # mutants/: mutmut would keep the results of unchanged sources, however the tests changed
mkdir -p "$tree"
cp -r "$root/pagedserve" "$root/tests" "$tree/"
for folder in shared runtime gateway worker bench; do
    cp -r "$root/$folder" "$tree/pagedserve/$folder"
done
cp -r "$root/paged_kernels" "$tree/pagedserve/kernels"  # installed as pagedserve.kernels (pyproject's package-dir)
cp "$root/pyproject.toml" "$tree/"
cd "$tree"
# mutmut forks each mutant's run from a process that has run torch: with a thread pool already
# started there (OpenMP is not fork-safe) a child that runs the engine hangs, and every mutant of
# the engine loop read as "timed out". One thread each (mutmut runs the children side by side).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec "$mutmut" run "$@"
