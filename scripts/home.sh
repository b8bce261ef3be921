# shellcheck shell=bash
# Sourced by the setup scripts: where radixgate keeps what it builds, the one place the shell reads it.
# RADIXGATE_HOME is also the gateway's `home` setting (service/config_engine.py: HomeSettings and
# home_engine_paths name the same paths; tests/test_home_setting.py checks that they agree).
RG_HOME=${RADIXGATE_HOME:-$HOME/.cache/radixgate}
RG_HOME=${RG_HOME/#\~/$HOME}                       # a quoted "~/..." as the gateway expands it
RG_ENGINE_VENV=$RG_HOME/engine-venv                # engine.python: $RG_ENGINE_VENV/bin/python
RG_MODEL_DIR=$RG_HOME/models/SmolLM2-135M-Instruct # engine.model_path
RG_PEERS_DIR=$RG_HOME/peers                        # the bench's peers (scripts/peers/setup.sh)
