# An actor on a GPU: grpo-pipeline on SGLang's image, so that `actor.engine: sglang` (configs/compose-gpu.yaml) can
# launch `python -m sglang.launch_server` next to it. docker-compose.gpu.yml builds it; without a GPU the actors run
# the project's own image (docker/Dockerfile) with the local engine. SGLang's images ship CUDA 13 (a recent driver);
# lmsysorg/sglang:v0.5.19-cu129 is the last CUDA 12 tag. Both bases are build arguments (SGLANG_IMAGE, PYTHON_IMAGE).
# Layers from the least to the most often changed: the dependencies (reinstalled only when pyproject.toml's lists or
# docker/constraints.txt change), then the source (an edit reinstalls nothing but the project itself). The run's
# config is not in the image: compose mounts ./configs and Kubernetes a ConfigMap at /app/configs.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# The dependency list alone: its text, and so the layers below, stay the same across edits to anything else.
FROM ${PYTHON_IMAGE} AS requirements
COPY pyproject.toml docker/requirements.py /src/
RUN python3 /src/requirements.py requirements /src/pyproject.toml data > /requirements.txt

FROM ${SGLANG_IMAGE}
# A user of its own, the learner's id: both write the shared run volume. It owns the directories the named volumes
# start from, so Docker creates the volumes writable by it; SGLang's kernel caches go to its home.
RUN groupadd --gid 10001 grpo \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/grpo --shell /usr/sbin/nologin grpo \
    && mkdir -p /app/configs /weights /runs /hf-cache /demo-model \
    && chown grpo:grpo /weights /runs /hf-cache /demo-model
WORKDIR /app
COPY docker/requirements.py docker/constraints.txt docker/pip.sh /tmp/deps/
COPY --from=requirements /requirements.txt /tmp/deps/requirements.txt
# The image's torch, transformers and sglang stay as they are (requirements.py leaves out the pins of what is
# installed): only what they lack is added, at the pinned versions.
RUN python3 /tmp/deps/requirements.py constraints /tmp/deps/constraints.txt > /tmp/deps/pins.txt \
    && sh /tmp/deps/pip.sh install -r /tmp/deps/requirements.txt -c /tmp/deps/pins.txt
COPY pyproject.toml README.md ./
COPY common ./common
COPY actor ./actor
COPY learner ./learner
COPY grader ./grader
COPY env ./env
# The operator's commands too: `grpo status` and `grpo dead` run from inside a container.
COPY ops ./ops
RUN sh /tmp/deps/pip.sh install --no-deps . && rm -rf /tmp/deps \
    && python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
ENV PYTHONUNBUFFERED=1 HOME=/home/grpo
USER 10001:10001
CMD ["grpo", "actor", "--config", "/app/configs/compose-gpu.yaml"]
