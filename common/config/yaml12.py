"""YAML as the config reads it: YAML 1.2's booleans, plain values only.

PyYAML's YAML 1.1 reads ``on``, ``off``, ``yes`` and ``no`` as booleans, which would turn the documented
``chat_template: off`` into ``False``; here only ``true`` and ``false`` are. Boolean keys still take those words, as
pydantic reads them.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: ``true``/``false`` only, so ``off`` stays the text "off"."""


_BOOL = "tag:yaml.org,2002:bool"
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def read_yaml(text: str) -> Any:
    """One YAML document, as every config file and ``-o`` value is read."""
    return yaml.load(text, Loader=YamlLoader)  # a SafeLoader: plain values only, never objects
