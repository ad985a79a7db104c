#!/usr/bin/env bash
# Chromium for the dashboard's browser test (tests/gateway/test_dashboard_browser.py), from Debian's
# package, when it is missing and this user can install packages; otherwise say so and go on (the
# test skips, or fails under PAGEDSERVE_REQUIRE_BROWSER=1). Idempotent: a second run does nothing.
set -euo pipefail
for name in chromium chromium-browser google-chrome; do
    command -v "$name" >/dev/null 2>&1 && exit 0
done
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "install_browser: no Chromium and no root apt-get here; install chromium to run the browser test" >&2
    exit 0
fi
echo "==> installing chromium (Debian package) for the browser test" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends chromium >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends chromium >/dev/null; }
