# An actor: grpo-pipeline on SGLang's image, so that `actor.engine=sglang` can launch `python -m sglang.launch_server`
# next to it. SGLang's images ship CUDA 13 (a recent driver); lmsysorg/sglang:v0.5.19-cu129 is the last CUDA 12 tag.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY actor ./actor
COPY learner ./learner
COPY grader ./grader
COPY configs ./configs
# The image's torch, transformers and sglang stay as they are: only what they lack is added.
RUN pip install --no-cache-dir ".[data]" && python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
ENV PYTHONUNBUFFERED=1
CMD ["grpo", "actor", "--config", "/app/configs/compose.yaml", "-o", "actor.engine=sglang"]
