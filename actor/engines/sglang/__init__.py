"""The ``sglang`` engine: a client of a SGLang server's native HTTP API (:mod:`actor.engines.sglang.engine`), its
requests and replies as pure functions (:mod:`actor.engines.sglang.requests`, torch-free), the HTTP client with
bounded retries (:mod:`actor.engines.sglang.client`), the server an actor launches (:mod:`actor.engines.sglang.server`),
SGLang's adapter API (:mod:`actor.engines.sglang.adapters`), its update groups for weights over NCCL
(:mod:`actor.engines.sglang.nccl`) and what requests wait for while broadcast weights are
taken (:mod:`actor.engines.sglang.unannounced`)."""
