"""The built-in graders' names, in one list: the config tree accepts these for ``grader.name`` and grader/'s registry
is built from them, so a grader cannot be configurable without being buildable, or the reverse.

It imports nothing: a grader worker process reads it without loading the config's libraries.
"""

from __future__ import annotations

PLAIN = ("addition", "exact", "gsm8k", "math", "reasoning_gym")  # the name alone is the grader
REGEX = "regex"  # the answer is a pattern's one group
FORMAT = "format"  # the whole completion has a layout
WITH_PATTERN = (REGEX, FORMAT)  # take grader.pattern
BUILTIN = (*PLAIN, *WITH_PATTERN)
COMBINE = "combine"  # the weighted mean of components, each a built-in or a custom grader
SERVICE = "service"  # an HTTP scorer (a judge model, say): grader.url, batched, with retries
CUSTOM = r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"  # your own grader as module.path:function
