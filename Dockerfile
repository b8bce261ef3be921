# The gateway image (light: no torch, no SGLang). Workers use SGLang's own image.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY tenancy ./tenancy
COPY policies ./policies
COPY loadgen ./loadgen
RUN pip install --no-cache-dir ".[otel]"
# the API; 9100: the operator endpoints when RADIXGATE_SECURITY__OPERATOR_PORT=9100 (compose, deploy/k8s)
EXPOSE 8000 9100
CMD ["python", "-m", "service", "serve"]
