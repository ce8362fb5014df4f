#!/usr/bin/env bash
# Builds .gpu/whl: the pure-Python and cp312 packages the bench and quickstart calls need on the lent GPU machine
# (Python 3.12, torch 2.11, transformers, peft, accelerate -- but no trl, datasets, pydantic, liger-kernel or
# DeepSpeed), packed into one archive that travels in a device call's `carry` and unpacks into /tmp/site:
#
#   bash bench/gpu_kit.sh                       # here, on the CPU machine (pip reaches PyPI); 1-3 minutes
#   run(command="source .gpu/whl/setup.sh && ...", carry=[".gpu/whl"])   # there; bench/*_call.sh source it
#
# It also builds .gpu/whl-rl, the same without DeepSpeed and pydantic (1.7 MB against 5.2), for calls that carry the
# vLLM kit too (.gpu/vllm, 39 MB, brings pydantic): the checkout (23 MB) + both full kits pass a call's 64 MiB.
# bench/*_call.sh source .gpu/whl, else .gpu/whl-rl.
#
# A fresh checkout has no .gpu/ (it is ignored), so each new checkout builds the kit once. DeepSpeed has no wheel
# on PyPI: it is built here from its sdist with DS_BUILD_OPS=0 (its ops compile on first use, ninja included).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.gpu/whl
PACKAGES=(
  trl==1.16.0 datasets==4.8.5 multiprocess dill xxhash liger-kernel==0.8.5
  pydantic==2.12.5 pydantic-core==2.41.5 annotated-types typing-inspection
  hjson msgpack ninja py-cpuinfo einops
)
PLATFORM=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$KIT" "$work/wheels" "$work/site"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$work/wheels" "${PACKAGES[@]}"
# DeepSpeed: a py3-none-any wheel from the sdist, ops left to build at run time
python3 -m pip download -q --no-deps --no-binary :all: -d "$work/sdist" deepspeed==0.19.8
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$work/wheels" "$work"/sdist/deepspeed-*.tar.gz
for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/site"; done
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work/site" -cf - . | xz -6 -T2 > "$KIT/site.tar.xz"
mkdir -p "$KIT-rl"
(cd "$work/site" && rm -rf deepspeed* ninja* msgpack* hjson* cpuinfo* py_cpuinfo* einops* pydantic* annotated_types* \
  typing_inspection* && tar -cf - . | xz -9 -T2 > "../site-rl.tar.xz") && mv "$work/site-rl.tar.xz" "$KIT-rl/site.tar.xz"
cat > "$KIT/setup.sh" << 'EOF'
# source .gpu/whl/setup.sh: unpacks the kit into /tmp/site and puts it on PYTHONPATH
_kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p /tmp/site && tar -C /tmp/site -xJf "$_kit/site.tar.xz"
export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" DS_BUILD_OPS=0
chmod +x /tmp/site/ninja/data/bin/ninja 2> /dev/null && export PATH="/tmp/site/ninja/data/bin:$PATH"
EOF
cp "$KIT/setup.sh" "$KIT-rl/setup.sh"
du -sh "$KIT" "$KIT-rl"
