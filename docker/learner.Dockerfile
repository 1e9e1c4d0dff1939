# The learner: grpo-pipeline on a CUDA PyTorch image (torch comes from the base; pip keeps it).
ARG TORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${TORCH_IMAGE}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY actor ./actor
COPY learner ./learner
COPY grader ./grader
COPY configs ./configs
RUN pip install --no-cache-dir ".[data]"
ENV PYTHONUNBUFFERED=1
CMD ["grpo", "learner", "--config", "/app/configs/compose.yaml"]
