#!/usr/bin/env bash
# Wheels for the device machine's Python 3.12 (no package registry there): the runtime
# dependencies of tailserve that its image lacks, saved in .whl/ (git-ignored locally with
# `echo /.whl/ >> .git/info/exclude`), which benchmarks/gpu_check.sh installs to /tmp/site.
# Versions: the ones this checkout's venv resolved on 2026-12-04. Run here, in the repository root.
set -euo pipefail
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64)
for spec in ddsketch==3.0.1 starlette==1.10.0 hypercorn==0.18.0 uvicorn==0.55.0 httptools==0.9.0 llguidance==1.9.1 \
            bm25s==0.3.16 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
        -d .whl "$spec"
done
ls .whl
