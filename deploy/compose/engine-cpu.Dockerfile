# The CPU SGLang worker of compose.yaml's cpu profile: the project's own engine setup (scripts/engine/setup.sh:
# SGLang on CPU torch, the sgl_kernel shim) in an image, run by `python -m service worker`. The model is mounted.
FROM python:3.11-slim
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      build-essential libnuma1 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY tenancy ./tenancy
COPY policies ./policies
COPY loadgen ./loadgen
COPY scripts ./scripts
RUN pip install --no-cache-dir .
ENV RADIXGATE_HOME=/opt/radixgate HF_HUB_OFFLINE=1
RUN bash scripts/engine/setup.sh
EXPOSE 30000
CMD ["python", "-m", "service", "worker", "--port", "30000"]
