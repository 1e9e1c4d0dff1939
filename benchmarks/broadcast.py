"""B4 weights to many actors: the time for one version to reach K actors' models, over ``weights.transport: nccl``
(the learner's bucketed broadcast, learner.nccl_weights.send_buckets, into the local engine's own receive) against the
disk path measured in the same run (``publish`` once, then every actor's ``load_state_dict`` + ``load_into`` at
once). Each actor is its own process, in one update group formed before the trials (a steady state).

    .venv/bin/python benchmarks/broadcast.py [--quick] [--backend gloo|nccl] [--out result.json]

gloo (the default) runs on CPUs over loopback: a stand-in for the network, not a measure of NCCL. With ``--backend
nccl`` and K + 1 GPUs, the learner uses cuda:0 and actor i cuda:i. The figure per K is disk seconds ÷ broadcast
seconds (above 1: the broadcast is faster), the median of the trials; there is no goal. Prints one JSON object.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import harness  # noqa: E402
import torch  # noqa: E402

from common.ports import free_port  # noqa: E402
from common.weights import publish  # noqa: E402
from common.weights.nccl import NcclRound, assign_ranks, close_group, open_group  # noqa: E402

TIMEOUT_S = 300.0


def receiver(model_dir: str, device: str) -> int:
    """An actor's engine, driven by JSON lines on stdin: ``disk`` (an announcement), ``join`` and ``recv`` (a round)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from actor.engines.local import LocalEngine
    from common.config import Config
    from common.schemas import WeightsAnnouncement

    hf_logging.disable_progress_bar()
    engine = LocalEngine.__new__(LocalEngine)  # the real engine's weight paths, without a tokenizer or sampling
    # Versions are published beside the model (weights-<k>/): the engine reads only inside its weights.dir.
    weights_dir = str(Path(model_dir).parent)
    engine.cfg = Config.model_validate(
        {"model": {"path": model_dir, "device": device}, "weights": {"dir": weights_dir}}
    )
    engine.model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    engine.version = 0
    engine._group = None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "disk":
            engine.load(WeightsAnnouncement.from_hash(cmd["ann"]))
        elif cmd["op"] == "join":
            engine.join_group(NcclRound.from_json(cmd["round"]), cmd["offset"], TIMEOUT_S)
        elif cmd["op"] == "recv":  # the buckets, then loaded into the model (as the round's announcement does)
            rnd = NcclRound.from_json(cmd["round"])
            engine.receive(rnd, TIMEOUT_S)
            engine.commit(rnd)
        print(json.dumps({"done": cmd["op"]}), flush=True)
    engine.close()
    return 0


class Actors:
    def __init__(self, k: int, model_dir: Path, backend: str):
        devices = [f"cuda:{i + 1}" if backend == "nccl" else "cpu" for i in range(k)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--receiver", str(model_dir), "--device", d],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for d in devices
        ]
        self.wait()

    def send(self, cmds: list[dict[str, Any]]) -> None:
        for p, cmd in zip(self.procs, cmds, strict=True):
            assert p.stdin is not None
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()

    def wait(self) -> None:
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"an actor process exited with {p.wait()}")

    def close(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.close()  # the end of its commands: it leaves its group and exits
                p.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()


def case(model: torch.nn.Module, model_dir: Path, root: Path, k: int, trials: int, backend: str) -> dict[str, Any]:
    from learner.nccl_weights import send_buckets, snapshot

    actors = Actors(k, model_dir, backend)
    pg = None
    try:
        offsets, world = assign_ranks({f"a{i}": 1 for i in range(k)})
        buckets = snapshot(model, None, "model").buckets
        rnd = NcclRound("bench", 1, 1, f"bench-{k}", "127.0.0.1", free_port(), world, backend, offsets, buckets)
        actors.send([{"op": "join", "round": rnd.to_json(), "offset": offsets[f"a{i}"]} for i in range(k)])
        pg = open_group(address=rnd.address, port=rnd.port, world_size=world, rank=0, group_name=rnd.group,
                        backend=backend, timeout_s=TIMEOUT_S)  # fmt: skip
        actors.wait()
        disk_s, broadcast_s = [], []
        for v in range(1, trials + 1):
            t0 = time.perf_counter()
            ann = publish(model, None, root, v, keep=2, prune_in_background=True).announcement
            actors.send([{"op": "disk", "ann": ann.to_hash()}] * k)
            actors.wait()
            disk_s.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            snap = snapshot(model, None, "model")  # the learner's CPU copy, as publish() makes it
            actors.send([{"op": "recv", "round": rnd.to_json()}] * k)
            send_buckets(pg, snap, TIMEOUT_S, backend)
            actors.wait()
            broadcast_s.append(time.perf_counter() - t0)
        ratios = [d / b for d, b in zip(disk_s, broadcast_s, strict=True)]
        # Each trial's seconds too, that the medians can be checked against.
        return {"receivers": k, "disk_s": statistics.median(disk_s), "broadcast_s": statistics.median(broadcast_s),
                "ratio": statistics.median(ratios), "buckets": len(buckets), "trials_disk_s": disk_s,
                "trials_broadcast_s": broadcast_s}  # fmt: skip
    finally:
        if pg is not None:
            close_group(pg)
        actors.close()


def run(quick: bool, backend: str = "gloo") -> dict[str, object]:
    import weights  # B4's model sizes
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    size = "25m" if quick else "100m"
    model, n_params = weights.build(size)
    if backend == "nccl":
        torch.cuda.set_device(0)
    counts = [1, 2] if quick else [1, 2, 4]
    if backend == "nccl":
        counts = [k for k in counts if k + 1 <= torch.cuda.device_count()]
    with tempfile.TemporaryDirectory(prefix="grpo-bench-broadcast-") as tmp:
        model_dir = Path(tmp) / "model"
        model.save_pretrained(model_dir)
        cases = [case(model, model_dir, Path(tmp) / f"weights-{k}", k, 3 if quick else 5, backend) for k in counts]
    return {"name": "B4 weights to many actors", "backend": backend, "parameters": n_params, "bytes": n_params * 4,
            "cases": cases}  # fmt: skip


def main() -> int:
    if "--receiver" in sys.argv:
        i = sys.argv.index("--receiver")
        return receiver(sys.argv[i + 1], sys.argv[sys.argv.index("--device") + 1])
    p = harness.parser(__doc__, "a smaller model, 1 and 2 actors, fewer trials")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    args = p.parse_args()
    return harness.emit(run(args.quick, args.backend), args.out)


if __name__ == "__main__":
    sys.exit(main())
