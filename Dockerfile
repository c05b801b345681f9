# Images for the four MiniCPM-o 4.5 services, one build target each:
#
#   thinker-cuda  talker-cuda  code2wav-cuda   GPU stages on a CUDA runtime base
#   thinker-cpu   talker-cpu   code2wav-cpu    CPU variants (laptops, CI, the compose smoke run)
#   gateway                                    FastAPI gateway on a slim Python base
#
#   docker build --target thinker-cuda -t minicpmo-serve:0.1.0-thinker-cuda .
#
# No weights are baked in or fetched at build time: mount the checkpoint directory read-only at
# /models (compose and the Helm chart do). Every image runs as the unprivileged user 10001.
# Offline builds: fill docker/wheelhouse/ with wheels and pass --build-arg PIP_OFFLINE=1
# (scripts/compose-smoke does this). The base images are build args so a mirror or a locally
# imported root filesystem can stand in for them.

ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm
ARG GATEWAY_BASE_IMAGE=python:3.11-slim-bookworm

# ===================================================================================================
# Stage order matters for the classic (non-BuildKit) builder, which builds every stage up to the target:
# the CPU variants come first and the CUDA variants last, so a CPU or gateway build never needs the CUDA
# base image. Per variant: python-* (base + Python + the unprivileged user), build-* (the venv, in its own
# stage so pip caches and wheels never reach an image), runtime-* (base + venv + entrypoint), targets.
# The ENTRYPOINT fills MINICPMO_STAGE_SETTINGS from the deploy profile (docker/entrypoint.py) and execs the
# command, so the service itself is the process that receives SIGTERM.
#
# CPU stage images

FROM ${CPU_BASE_IMAGE} AS python-cpu
COPY docker/ensure-python.sh /usr/local/sbin/ensure-python.sh
RUN sh /usr/local/sbin/ensure-python.sh

FROM python-cpu AS build-cpu
ARG PIP_OFFLINE=0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints/ constraints/
COPY docker/pip-install.sh docker/pip-install.sh
COPY docker/wheelhouse/ docker/wheelhouse/
RUN PIP_OFFLINE=${PIP_OFFLINE} TORCH_INDEX_URL=${TORCH_INDEX_URL} sh docker/pip-install.sh deps
COPY services/ services/
COPY gateway/ gateway/
RUN PIP_OFFLINE=${PIP_OFFLINE} sh docker/pip-install.sh project

FROM python-cpu AS runtime-cpu
COPY --from=build-cpu /opt/venv /opt/venv
COPY docker/grpc_health_probe.py docker/entrypoint.py /opt/minicpmo/docker/
COPY configs/deploy/ /opt/minicpmo/configs/deploy/
ENV PATH=/opt/venv/bin:$PATH HOME=/home/minicpmo PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 NUMBA_CACHE_DIR=/tmp/numba MINICPMO_CHECKPOINT=/models/MiniCPM-o-4_5 \
    MINICPMO_DEVICE=cpu OMP_NUM_THREADS=2
WORKDIR /home/minicpmo
USER 10001:10001
ENTRYPOINT ["python", "/opt/minicpmo/docker/entrypoint.py"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "/opt/minicpmo/docker/grpc_health_probe.py"]
CMD ["sh", "-c", "exec python -m services.${MINICPMO_STAGE} --checkpoint \"${MINICPMO_CHECKPOINT}\" --device ${MINICPMO_DEVICE} --port ${MINICPMO_GRPC_PORT}"]

FROM runtime-cpu AS thinker-cpu
ENV MINICPMO_STAGE=thinker MINICPMO_GRPC_PORT=50051
EXPOSE 50051 51051

FROM runtime-cpu AS talker-cpu
ENV MINICPMO_STAGE=talker MINICPMO_GRPC_PORT=50052
EXPOSE 50052 51052

FROM runtime-cpu AS code2wav-cpu
ENV MINICPMO_STAGE=code2wav MINICPMO_GRPC_PORT=50053
EXPOSE 50053 51053

# ===================================================================================================
# Gateway image

FROM ${GATEWAY_BASE_IMAGE} AS python-gateway
COPY docker/ensure-python.sh /usr/local/sbin/ensure-python.sh
RUN sh /usr/local/sbin/ensure-python.sh

# The gateway forwards tensors' bytes and never imports torch: its venv has no torch, transformers or
# CUDA wheels (pyproject.toml [tool.minicpmo] gateway-dependencies), and the build checks that it starts.
FROM python-gateway AS build-gateway
ARG PIP_OFFLINE=0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints/ constraints/
COPY docker/pip-install.sh docker/pip-install.sh
COPY docker/wheelhouse/ docker/wheelhouse/
RUN PIP_OFFLINE=${PIP_OFFLINE} sh docker/pip-install.sh deps-gateway
COPY services/ services/
COPY gateway/ gateway/
RUN PIP_OFFLINE=${PIP_OFFLINE} sh docker/pip-install.sh project-gateway

FROM python-gateway AS gateway
COPY --from=build-gateway /opt/venv /opt/venv
COPY docker/http_health_probe.py docker/entrypoint.py /opt/minicpmo/docker/
COPY configs/deploy/ /opt/minicpmo/configs/deploy/
# The voice registry's directory (deploy profile gateway.voice_dir), owned by the runtime user so a
# fresh named volume mounted there inherits a writable owner.
RUN mkdir -p /var/lib/minicpmo/voices && chown 10001:10001 /var/lib/minicpmo/voices
ENV PATH=/opt/venv/bin:$PATH HOME=/home/minicpmo PYTHONUNBUFFERED=1 MINICPMO_HTTP_PORT=8099
WORKDIR /home/minicpmo
USER 10001:10001
EXPOSE 8099
ENTRYPOINT ["python", "/opt/minicpmo/docker/entrypoint.py"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/opt/minicpmo/docker/http_health_probe.py"]
CMD ["sh", "-c", "exec python -m gateway --host 0.0.0.0 --port ${MINICPMO_HTTP_PORT} --thinker-addr dns:///thinker:50051 --talker-addr dns:///talker:50052 --code2wav-addr dns:///code2wav:50053"]

# ===================================================================================================
# CUDA stage images

FROM ${CUDA_BASE_IMAGE} AS python-cuda
COPY docker/ensure-python.sh /usr/local/sbin/ensure-python.sh
RUN sh /usr/local/sbin/ensure-python.sh

FROM python-cuda AS build-cuda
ARG PIP_OFFLINE=0
# Empty: PyPI's default torch wheel, which is the CUDA build.
ARG TORCH_INDEX_URL=""
WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints/ constraints/
COPY docker/pip-install.sh docker/pip-install.sh
COPY docker/wheelhouse/ docker/wheelhouse/
RUN PIP_OFFLINE=${PIP_OFFLINE} TORCH_INDEX_URL=${TORCH_INDEX_URL} sh docker/pip-install.sh deps
COPY services/ services/
COPY gateway/ gateway/
RUN PIP_OFFLINE=${PIP_OFFLINE} sh docker/pip-install.sh project

FROM python-cuda AS runtime-cuda
COPY --from=build-cuda /opt/venv /opt/venv
COPY docker/grpc_health_probe.py docker/entrypoint.py /opt/minicpmo/docker/
COPY configs/deploy/ /opt/minicpmo/configs/deploy/
ENV PATH=/opt/venv/bin:$PATH HOME=/home/minicpmo PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 NUMBA_CACHE_DIR=/tmp/numba MINICPMO_CHECKPOINT=/models/MiniCPM-o-4_5 \
    MINICPMO_DEVICE=cuda
WORKDIR /home/minicpmo
USER 10001:10001
ENTRYPOINT ["python", "/opt/minicpmo/docker/entrypoint.py"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/minicpmo/docker/grpc_health_probe.py"]
# sh only expands the variables; exec makes the stage the process that gets the runtime's SIGTERM.
CMD ["sh", "-c", "exec python -m services.${MINICPMO_STAGE} --checkpoint \"${MINICPMO_CHECKPOINT}\" --device ${MINICPMO_DEVICE} --port ${MINICPMO_GRPC_PORT}"]

FROM runtime-cuda AS thinker-cuda
ENV MINICPMO_STAGE=thinker MINICPMO_GRPC_PORT=50051
EXPOSE 50051 51051

FROM runtime-cuda AS talker-cuda
ENV MINICPMO_STAGE=talker MINICPMO_GRPC_PORT=50052
EXPOSE 50052 51052

FROM runtime-cuda AS code2wav-cuda
ENV MINICPMO_STAGE=code2wav MINICPMO_GRPC_PORT=50053
EXPOSE 50053 51053
