# The executor service on a CUDA GPU (torch + CuPy kernels). The same image runs the CPU backend.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY kernels kernels
# One torch pin: the Makefile's TORCH_VERSION, which the CPU tests run (a test holds the two equal).
# The GPU measurements so far (the RESULTS commits) ran torch 2.11.0 on CUDA 13; this image has not been
# built or run with 2.13.0 on the GPU. To reproduce those runs: --build-arg TORCH_VERSION=2.11.0.
# Either way the torch wheel must be a CUDA 13 build, matching this base image and cupy-cuda13x.
ARG TORCH_VERSION=2.13.0
# torch first, explicitly; then the project with its executor and GPU extras.
RUN pip install --no-cache-dir torch==${TORCH_VERSION} \
 && pip install --no-cache-dir '.[executor,gpu]'
EXPOSE 50052
CMD ["pagedserve-executor"]
