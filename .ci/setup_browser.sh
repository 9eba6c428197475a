#!/usr/bin/env bash
# CI: make sure a headless browser is on PATH for tests/test_hlo_html.py (Debian's `chromium`).
# Idempotent: does nothing when `chromium` is already installed. Needs root (or passwordless sudo) and apt-get.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_browser.sh: chromium is not installed and apt-get is not available; install chromium" \
       "(or set CHROMIUM=/path/to/chrome) before running the tests" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "setup_browser.sh: installing chromium needs root (or passwordless sudo)" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null >/dev/null
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium </dev/null >/dev/null
command -v chromium >/dev/null 2>&1 || { echo "setup_browser.sh: chromium still not on PATH after install" >&2; exit 1; }
echo "setup_browser.sh: installed $(chromium --version 2>/dev/null | head -1)"
