"""The policy model outside the learner's training step: loading an HF-format directory (common.model.loading),
turning a source into one (common.model.importing, ``grpo import-model``) and sampling from it with transformers
(common.model.generation). Each is imported from its module: this face imports nothing, so that naming one does not
load torch for the others."""
