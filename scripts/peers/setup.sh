#!/usr/bin/env bash
# Installs what `python -m loadgen bench-gateway` compares radixgate with, each in its own virtualenv under
# $RADIXGATE_HOME/peers (default ~/.cache/radixgate/peers, where the bench looks), plus Debian's wrk:
#   router/   sglang-router 0.3.2 (Rust router of SGLang; `python -m sglang_router.launch_router`)
#   litellm/  LiteLLM proxy 1.110.2 (`litellm --config ...`)
# Idempotent: a second run only checks. `PEERS="router"` (or "litellm") installs one of them.
#
# LiteLLM's `litellm[proxy]` extra cannot be installed from the registry as is: it pins `litellm-proxy`
# (absent from the registry) and exact versions of `litellm-proxy-extras` / `litellm-enterprise` that are
# not published. So litellm itself is installed, then the proxy extra's other requirements by hand, with
# the newest published litellm-proxy-extras and litellm-enterprise.
set -euo pipefail
cd "$(dirname "$0")/../.."

# shellcheck source=../home.sh
. scripts/home.sh  # RG_PEERS_DIR: $RADIXGATE_HOME/peers
PEERS_DIR=$RG_PEERS_DIR
PEERS=${PEERS:-"router litellm"}
ROUTER_VERSION=${ROUTER_VERSION:-0.3.2}
LITELLM_VERSION=${LITELLM_VERSION:-1.110.2}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
mkdir -p "$PEERS_DIR"

if ! command -v wrk >/dev/null 2>&1; then
  echo "[peers] installing wrk (Debian package)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq wrk >/dev/null
fi

venv() {  # venv NAME: create $PEERS_DIR/NAME with a current pip
  local dir="$PEERS_DIR/$1"
  if [ ! -x "$dir/bin/python" ]; then
    echo "[peers] creating $dir"
    "$PY" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
  fi
}

for peer in $PEERS; do
  case "$peer" in
    router)
      venv router
      stamp="$PEERS_DIR/router/.installed-$ROUTER_VERSION"
      if [ ! -f "$stamp" ]; then
        echo "[peers] installing sglang-router==$ROUTER_VERSION"
        "$PEERS_DIR/router/bin/python" -m pip install -q "sglang-router==$ROUTER_VERSION"
        touch "$stamp"
      fi
      "$PEERS_DIR/router/bin/python" -c "import sglang_router" ;;
    litellm)
      venv litellm
      stamp="$PEERS_DIR/litellm/.installed-$LITELLM_VERSION"
      if [ ! -f "$stamp" ]; then
        echo "[peers] installing litellm==$LITELLM_VERSION and its proxy requirements by hand"
        "$PEERS_DIR/litellm/bin/python" -m pip install -q "litellm==$LITELLM_VERSION" \
          litellm-proxy-extras litellm-enterprise \
          'uvicorn>=0.33,<1' 'uvloop>=0.22.1,<1' 'fastapi>=0.136.3,<1' 'starlette>=1.0.1,<2' \
          'gunicorn>=23,<24' 'granian>=2.7.4,<3' 'backoff>=2.2.1,<3' 'pyyaml>=6.0.3,<7' 'rq>=2.7,<3' \
          'orjson>=3.11.6,<4' 'hiredis>=3,<4' 'apscheduler>=3.11.2,<4' 'fastapi-sso>=0.19,<1' \
          'pyjwt>=2.13,<3' 'python-multipart>=0.0.27,<1' 'cryptography>=49,<51' 'pynacl>=1.6.2,<2' \
          'websockets>=15.0.1,<16' 'azure-identity>=1.25.2,<2' 'azure-storage-blob>=12.28,<13' \
          'mcp>=2.3,<3' 'httpx2>=2.10,<3' 'restrictedpython>=8.5,<9' 'rich>=13.9.4,<14' \
          'inquirerpy>=0.3.4,<1' 'tomlkit>=0.13.3,<1' 'polars>=1.38.1,<2' 'soundfile>=0.12.1,<1' \
          'pyroscope-io>=0.8.16,<1' 'expression>=5.6,<6' 'backports-zstd>=1,<2' 'semver>=3.0.4,<4'
        touch "$stamp"
      fi
      LITELLM_LOCAL_MODEL_COST_MAP=True "$PEERS_DIR/litellm/bin/python" -c "import litellm.proxy.proxy_server" ;;
    *) echo "[peers] unknown peer '$peer' (router, litellm)" >&2; exit 2 ;;
  esac
  echo "[peers] $peer ready in $PEERS_DIR/$peer"
done
