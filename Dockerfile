# pagedserve: one image for the gateway and the workers.
# GPU workers: build with --build-arg TORCH_INDEX=<your CUDA wheel index>; CPU: the default CPU wheel.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=""
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE_DIR=/models

WORKDIR /app
# A C compiler: the CPU attention kernel (kernels/csrc) is compiled for the host CPU on first use.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install ${TORCH_INDEX:+--index-url $TORCH_INDEX} "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY gateway ./gateway
COPY worker ./worker
COPY kernels ./kernels
COPY pagedserve ./pagedserve
RUN pip install .

RUN useradd --create-home pagedserve && mkdir -p /models && chown pagedserve /models
USER pagedserve
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
CMD ["gateway", "--host", "0.0.0.0"]
