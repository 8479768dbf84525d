# The executor service on a CUDA GPU (torch + CuPy kernels) by default; the same image runs the CPU
# backend. A CPU-only image (what CI builds and runs, docker/compose.host-network.yml):
# --build-arg BASE_IMAGE=<Debian-like image with python3> --build-arg EXTRAS=executor, with a CPU
# torch wheel in docker/wheels/ (scripts/docker_local_images.sh puts one there).
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}
# the CUDA base has no Python; a base that has python3 with venv keeps its own
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
# One torch pin: the Makefile's TORCH_VERSION, which the CPU tests run (a test holds the two equal).
# The GPU measurements so far (the RESULTS commits) ran torch 2.11.0 on CUDA 13; this image has not been
# built or run with 2.13.0 on the GPU. To reproduce those runs: --build-arg TORCH_VERSION=2.11.0.
# On the GPU the torch wheel must be a CUDA 13 build, matching this base image and cupy-cuda13x.
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=executor,gpu
# torch first, explicitly, in a layer of its own that source changes leave cached: a wheel of the
# pinned version in docker/wheels/ (a +cpu build sorts above the index's) if there is one, else the
# index's build. Then the project with its executor (and GPU) extras.
COPY docker/wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --find-links /tmp/wheels torch==${TORCH_VERSION}
COPY pyproject.toml README.md ./
COPY protos protos
COPY pagedserve_common pagedserve_common
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY pagedserve_kernels pagedserve_kernels
RUN pip install --no-cache-dir ".[${EXTRAS}]"
EXPOSE 50052
CMD ["pagedserve-executor"]
