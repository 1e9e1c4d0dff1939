# The learner: grpo-pipeline on a CUDA PyTorch image (torch comes from the base; pip keeps it).
# Layers from the least to the most often changed: the dependencies (reinstalled only when pyproject.toml's lists or
# docker/constraints.txt change), then the source (an edit reinstalls nothing but the project itself). The run's
# config is not in the image: compose mounts ./configs and Kubernetes a ConfigMap at /app/configs.
ARG TORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

# The dependency list alone: its text, and so the layers below, stay the same across edits to anything else.
FROM python:3.12-slim AS requirements
# The extras to install, space-separated: "data tensorboard wandb" for run.trackers (their pins are in the
# constraints file too).
ARG EXTRAS="data"
COPY pyproject.toml docker/requirements.py /src/
RUN python /src/requirements.py requirements /src/pyproject.toml ${EXTRAS} > /requirements.txt

FROM ${TORCH_IMAGE}
# A user of its own (a fixed id, which Kubernetes' runAsNonRoot can check); it owns the directories the named volumes
# start from, so Docker creates the volumes writable by it.
RUN groupadd --gid 10001 grpo \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/grpo --shell /usr/sbin/nologin grpo \
    && mkdir -p /app/configs /weights /runs /hf-cache \
    && chown grpo:grpo /weights /runs /hf-cache
WORKDIR /app
COPY docker/requirements.py docker/constraints.txt /tmp/deps/
COPY --from=requirements /requirements.txt /tmp/deps/requirements.txt
RUN python3 /tmp/deps/requirements.py constraints /tmp/deps/constraints.txt > /tmp/deps/pins.txt \
    && python3 -m pip install --no-cache-dir -r /tmp/deps/requirements.txt -c /tmp/deps/pins.txt \
    && rm -rf /tmp/deps
COPY pyproject.toml README.md ./
COPY common ./common
COPY actor ./actor
COPY learner ./learner
COPY grader ./grader
# The operator's commands too: `grpo status` and `grpo dead` run from inside a container.
COPY ops ./ops
RUN python3 -m pip install --no-cache-dir --no-deps . && python3 -c "import common.cli, learner.main"
ENV PYTHONUNBUFFERED=1 HOME=/home/grpo
USER 10001:10001
CMD ["grpo", "learner", "--config", "/app/configs/compose.yaml"]
