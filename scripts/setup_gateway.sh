#!/usr/bin/env bash
# Installs what the gateway and the test suite need: Debian's redis-server, wrk (the load tool of
# `python -m loadgen bench-gateway`), Debian's prometheus (prometheus, promtool) and
# prometheus-alertmanager (prometheus-alertmanager, amtool) for the deploy/prometheus tests, and a light
# virtualenv (.venv) with radixgate and its dev tools.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
command -v wrk >/dev/null 2>&1 || missing="$missing wrk"
command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
command -v amtool >/dev/null 2>&1 || missing="$missing prometheus-alertmanager"
if [ -n "$missing" ]; then
  echo "[setup] installing$missing (Debian packages)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.radixgate-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing radixgate[dev] into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
echo "[setup] gateway environment ready (.venv)"
