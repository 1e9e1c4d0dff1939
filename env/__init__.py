"""Environments: what answers a model's turns in a multi-turn episode (``env.*`` in the config), beside the graders
that score the episode's last turn. The environment protocol and the tool environment (:mod:`env.environment`), the
episode driver between an engine and an environment (:mod:`env.episodes`), and the tools, run in the grader's worker
processes (:mod:`env.tools`; the built-in :mod:`env.calculator`). Each is imported from its module."""
