"""The engines an actor samples with, behind one contract (:mod:`actor.engines.base`: the :class:`Engine` protocol and
each engine's :class:`Capabilities`): ``local`` (transformers in this process, :mod:`actor.engines.local`), ``sim``
(random tokens for load tests, :mod:`actor.engines.sim`) and ``sglang`` (a SGLang server, :mod:`actor.engines.sglang`).
Callers outside the package take an engine from :func:`make_engine` and its contract from ``base``; each engine's
module is imported when it is chosen, so that the SGLang client loads no torch."""

from __future__ import annotations

from collections.abc import Callable

from actor.engines.base import Engine
from common.config import Config


def make_engine(cfg: Config, seed: int, *, name: str = "", on_event: Callable[[str], None] = lambda _: None) -> Engine:
    """``actor.engine``'s engine. ``name`` (the actor's id) names a SGLang server the engine launches; ``on_event``
    counts what it survived."""
    if cfg.actor.engine == "local":
        from actor.engines.local import LocalEngine

        return LocalEngine(cfg, seed)
    if cfg.actor.engine == "sim":
        from actor.engines.sim import SimEngine

        return SimEngine(cfg, seed)
    if cfg.actor.engine == "sglang":
        from actor.engines.sglang.engine import SGLangEngine

        return SGLangEngine(cfg, seed, name=name, on_event=on_event)
    raise ValueError(f"unknown engine {cfg.actor.engine!r}")
