"""The operator: what runs the pipeline and looks at it from outside, as opposed to the roles that make it up.

``grpo run``'s launcher (:mod:`ops.run`) and its live view (:mod:`ops.live_view`); the queries ``grpo status``
(:mod:`ops.status`) and ``grpo dead`` (:mod:`ops.dead`), which share :mod:`ops.query`; the demo model's builder
(:mod:`ops.tiny_model`, ``grpo make-tiny-model``); and the private ``redis-server`` of ``grpo run`` and of the tests
(:mod:`ops.redis_server`).

This part knows every role: it starts them by name and reads the run's keys they write. The rule that keeps that
one-way: nothing outside ``ops/`` imports it (no role, no grader, nothing in ``common/``), so a role's image or
process never depends on the operator's code (tests/unit/test_layering.py checks it).
"""
