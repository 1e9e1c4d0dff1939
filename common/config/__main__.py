"""``python -m common.config``: the configuration reference (docs/configuration.md), printed."""

from common.config.reference import reference_markdown

print(reference_markdown())
