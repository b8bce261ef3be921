# The gateway image (light: no torch, no SGLang). Workers use SGLang's own image.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY tenancy ./tenancy
COPY policies ./policies
COPY loadgen ./loadgen
RUN pip install --no-cache-dir ".[otel]"
EXPOSE 8000
CMD ["python", "-m", "service", "serve"]
