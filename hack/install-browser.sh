#!/usr/bin/env bash
# Debian's Chromium for the console's browser tests (tests/e2e/test_console.py), which drive it
# with Playwright for Python. Playwright's own browser download (`playwright install`) is never
# used: the tests launch /usr/bin/chromium.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
if [[ ! -x /usr/bin/chromium ]]; then
  apt_install chromium
fi
