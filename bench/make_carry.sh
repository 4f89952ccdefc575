#!/bin/bash
# .carry/: what the GPU host lacks for `bash bench/gpu_session.sh serving`, made here on the CPU from the
# venv and the package registry (the device tool's carry: [".carry"], 53 MB): the cp312 wheels of NumPy 1
# (the stubs), python-rapidjson and tritonclient (py3-none-any), the OpenAI front's packages and the
# openai client (.carry/front, 6 MB), and pytriton.tar.xz, the venv's pytriton wheel as installed, without
# what Python 3.12 does not need (Python 3.13's libpython, the 3.8-3.10 and 3.13 stubs): 26 MB against 36
# MB whole. With the tracked files (22 MB, most of them data/ and bench/results/) it is over the carry's
# 64 MiB: leave those two out of the index for the call (git rm -r --cached, then git reset).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=.venv/bin/pip
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
STUB_NUMPY=$(.venv/bin/python -c "from model_repo.serve import STUB_NUMPY; print(STUB_NUMPY)")
mkdir -p .carry
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --dest .carry \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "numpy==$STUB_NUMPY" python-rapidjson
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any --dest .carry \
    "tritonclient==$(.venv/bin/python -c "from importlib.metadata import version; print(version('tritonclient'))")"
# The OpenAI front's packages and the official client (bench.serving's OpenAI path), for Python 3.12.
$PIP download -q --only-binary=:all: --python-version 3.12 --dest .carry/front \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any fastapi uvicorn prometheus_client openai
tar cJf .carry/pytriton.tar.xz -C "$SITE" \
    --exclude='nvidia_pytriton.libs/libpython3-*.13.so*' --exclude='__pycache__' \
    --exclude='pytriton/tritonserver/python_backend_stubs/3.'{8,9,10,13} \
    pytriton nvidia_pytriton.libs nvidia_pytriton-0.7.0.dist-info
du -sh .carry/*
