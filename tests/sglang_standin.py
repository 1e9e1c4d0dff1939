"""A stand-in for a SGLang server, for tests on machines without a GPU: the request and reply shapes of SGLang 0.5.23's
native API (``/health``, ``/model_info``, ``/server_info``, ``/generate``, ``/update_weights_from_disk``,
``/pause_generation`` and ``/continue_generation`` (tests/sglang_standin_pause.py), the LoRA
adapters' ``/load_lora_adapter`` and ``/unload_lora_adapter`` (tests/sglang_standin_lora.py),
``/get_weights_by_name``, and the update-group calls: ``/init_weights_update_group``, ``/destroy_weights_update_group``,
``/begin_weight_update``, ``/update_weights_from_distributed``, ``/end_weight_update``), served over real HTTP, with a
real model on the CPU (transformers) so that token ids and log-probs are genuine, and a real torch.distributed group
(gloo) for the update group, joined the way SGLang's workers join it (``tcp://`` rendezvous, a store prefixed with the
group's name, a process group of that name; rank = rank_offset + tp_rank, tp_size 1 here).

Like SGLang it refuses unknown or mistyped ``sampling_params`` with HTTP 400, answers a batch or any ``n > 1`` with a
prompt-major JSON list, reports ``weight_version``, and answers a failed weight update with ``success: false``.
It only supports what the actor uses: plain temperature sampling (``top_p`` 1, ``top_k`` -1).

What the real server does after a ``/generate`` reply, it does too: for ``busy_s`` seconds the scheduler is not idle
yet (a ``/flush_cache?timeout=`` lets it settle sooner), so ``/update_weights_from_disk`` with ``flush_cache``
loads the weights and then answers HTTP 400 "Weights were updated, but the cache was not flushed …"; ``/generate``
then reports the new ``weight_version`` while ``/model_info`` keeps the old one (the tokenizer side updates its
version on success only) until ``/update_weight_version``. ``/flush_cache`` answers in text: refused while busy,
unless ``?timeout=`` lets it wait. A checkpoint whose shapes differ from the model's kills it, as an assertion in the
real scheduler's weight loader kills the real server (a process dies with SIGKILL; a thread stops serving).

In a test: ``StandIn(model_dir).start()`` (a thread; ``.url``, ``.requests``, ``.stop()``). As a process, with the
launch arguments of ``sglang.launch_server``: ``python -m tests.sglang_standin --model-path M --port P``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from tests.sglang_standin_lora import Adapters, LoraError, disabled
from tests.sglang_standin_pause import Pause

_SAMPLING_TYPES: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "max_new_tokens": (int,), "n": (int,),
    "stop": (str, list), "stop_token_ids": (list,), "skip_special_tokens": (bool,), "no_stop_trim": (bool,),
    "sampling_seed": (int,), "min_p": (int, float), "ignore_eos": (bool,),
}  # fmt: skip


class BadRequest(Exception):
    pass


class StandIn:
    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int = 0,
        weight_version: str = "default",
        busy_s: float = 0.0,
        lora: tuple[int, list[str], int | None] | None = None,
    ):
        """``lora``: launched with --enable-lora: (max_lora_rank, lora_target_modules, max_loaded_loras)."""
        from common.model.loading import load_pretrained

        self.model_path = model_path
        self.tokenizer, self.model = load_pretrained(model_path, "float32", "cpu")
        self.weight_version = weight_version  # what /model_info says (the tokenizer manager's)
        self.scheduler_version = weight_version  # what /generate replies carry (the scheduler's)
        self.busy_s = busy_s  # how long after a /generate reply the scheduler is not idle yet
        self._busy_until = 0.0
        self.requests: list[tuple[str, Any]] = []  # (path, JSON body) of every POST, in order
        self.fail_next_update = False
        self.cache_flushes = 0
        self.adapters = Adapters(self.model, *lora) if lora is not None else None
        self.groups: dict[str, Any] = {}  # update groups by name
        self.session = False  # between /begin_weight_update and /end_weight_update
        self.paused = Pause(weight_version)
        self._lock = threading.Lock()  # one generation or weight update at a time, as the scheduler serialises them
        self.control = {
            "/init_weights_update_group": self.init_group,
            "/destroy_weights_update_group": self.destroy_group,
            "/begin_weight_update": self.begin,
            "/end_weight_update": self.end,
            "/update_weights_from_distributed": self.update_distributed,
            "/pause_generation": self.paused.pause,
            "/continue_generation": self.paused.resume,
        }
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StandIn:
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- endpoints ----------------------------------------------------------------------------------------------

    def generate(self, body: dict) -> Any:
        if ("text" in body) == ("input_ids" in body):
            raise BadRequest("send exactly one of text or input_ids")
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
            raise BadRequest("input_ids must be a non-empty list of ints or of lists of ints")
        params = body.get("sampling_params") or {}
        for key, value in params.items():
            if key not in _SAMPLING_TYPES:
                raise BadRequest(f"unknown sampling_params key {key!r}")
            wrong_bool = isinstance(value, bool) and bool not in _SAMPLING_TYPES[key]  # bool is an int in Python
            if wrong_bool or not isinstance(value, _SAMPLING_TYPES[key]):
                raise BadRequest(f"sampling_params.{key}: wrong type {type(value).__name__}")
        if params.get("top_p", 1.0) != 1.0 or params.get("top_k", -1) not in (-1, 0):
            raise BadRequest("the stand-in samples plain temperature only (top_p 1, top_k -1)")
        n = int(params.get("n", 1))
        stop_ids = set(params.get("stop_token_ids") or [])
        if self.tokenizer.eos_token_id is not None and not params.get("ignore_eos"):
            stop_ids.add(self.tokenizer.eos_token_id)
        temperature = float(params.get("temperature", 1.0))
        self.paused.wait_unpaused()  # a request sent while paused waits for /continue_generation
        with self._lock:
            models = self._models(body.get("lora_path"), len(prompts))
            groups: list[Any] = [None] * len(prompts)
            for model in {id(m): m for m in models}.values():  # the prompts of each adapter (or the base) together
                mine = [i for i, m in enumerate(models) if m is model]
                for i, group in zip(mine, self.paused.generate(
                    model, [prompts[i] for i in mine], n, int(params.get("max_new_tokens", 128)),
                    stop_ids=stop_ids, pad_id=self.tokenizer.pad_token_id or 0,
                    temperature=temperature if temperature > 0 else None,
                    greedy_logprobs=bool(body.get("return_logprob")),  # a real server reports them at temperature 0
                ), strict=True):  # fmt: skip
                    groups[i] = group
            self._busy_until = time.monotonic() + self.busy_s
        out = []
        for prompt, group in zip(prompts, groups, strict=True):
            for s in group:
                finish = (
                    {"type": "stop", "matched": s.token_ids[-1]}
                    if s.finish_reason == "stop"
                    else {"type": "length", "length": len(s.token_ids)}
                )
                out.append({
                    "text": self.tokenizer.decode(s.token_ids),
                    "output_ids": s.token_ids,
                    "meta_info": {
                        "id": f"req-{len(self.requests)}-{len(out)}",
                        "finish_reason": finish,
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(s.token_ids),
                        "cached_tokens": 0,
                        "weight_version": self.paused.spans(s)[-1]["version"],
                        "weight_versions": self.paused.spans(s),
                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(s.logprobs, s.token_ids, strict=True)],
                    },
                })  # fmt: skip
        return out if batch or n > 1 else out[0]

    def _models(self, lora_path: Any, n_prompts: int) -> list[Any]:
        if lora_path is None:
            return [self.model] * n_prompts
        if self.adapters is None:
            raise disabled(lora_path)
        return self.adapters.models_for(lora_path, n_prompts)

    def lora_call(self, path: str, body: dict) -> tuple[int, dict]:
        """/load_lora_adapter and /unload_lora_adapter: refused as the real server refuses them without LoRA."""
        if self.adapters is None:
            return 400, {"success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora` to "
                         "enable LoRA."}  # fmt: skip
        with self._lock:
            return self.adapters.load(body) if path == "/load_lora_adapter" else self.adapters.unload(body)

    def update_weights(self, body: dict) -> tuple[int, dict]:
        from pathlib import Path

        from safetensors.torch import load_file

        from common.weights import load_into

        path = Path(str(body.get("model_path", "")))
        files = sorted(path.glob("*.safetensors"))
        if self.fail_next_update or not files:
            self.fail_next_update = False
            return 400, {"success": False, "message": f"failed to load weights from {path}", "num_paused_requests": 0}
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        params = self.model.state_dict()
        if any(k in params and v.shape != params[k].shape for k, v in state.items()):
            self.crash()
        # Paused, the requests wait between two steps, holding the generation lock: the update goes ahead of them.
        with self._lock if self.paused.mode is None else contextlib.nullcontext():
            load_into(self.model, state)
            if body.get("weight_version") is not None:
                self.scheduler_version = str(body["weight_version"])
                self.paused.serving(self.scheduler_version)
            if body.get("flush_cache", True):
                if self._busy():
                    message = ("Weights were updated, but the cache was not flushed because requests are still "
                               "running or queued. Retract or finish them, then call /flush_cache.")  # fmt: skip
                    return 400, {"success": False, "message": message, "num_paused_requests": 0}
                self.cache_flushes += 1
            self.weight_version = self.scheduler_version
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def crash(self) -> None:
        """What the real server does when its scheduler dies: the whole server goes, no reply."""
        if self.thread is None:  # a process of its own
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=self.stop, daemon=True).start()
        raise ConnectionAbortedError("the scheduler died")

    def _busy(self) -> bool:
        return time.monotonic() < self._busy_until or self.paused.busy()

    def flush_cache(self, query: dict[str, list[str]]) -> tuple[int, str]:
        timeout = float(query.get("timeout", ["0"])[0])
        if timeout > 0:  # waiting lets what kept the scheduler busy finish, as the real one's requests do
            self._busy_until = min(self._busy_until, time.monotonic() + 0.05)
        deadline = time.monotonic() + timeout
        while self._busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._busy():
            return 400, "Cache not flushed: requests are running or queued.\n"
        self.cache_flushes += 1
        return 200, "Cache flushed.\nPlease check backend logs for more details.\n"

    def update_weight_version(self, body: dict) -> tuple[int, dict]:
        if not isinstance(body.get("new_version"), str):
            raise BadRequest("new_version: missing or not str")
        self.weight_version = self.scheduler_version = body["new_version"]
        self.paused.serving(self.scheduler_version)
        return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                     "new_version": body["new_version"]}  # fmt: skip

    # -- the update group (SGLang's weight_updater: init/destroy, begin/end, update_weights_from_distributed) -------

    def init_group(self, body: dict) -> tuple[int, dict]:
        import datetime

        from torch.distributed import distributed_c10d as c10d

        for key, kind in (("master_address", str), ("master_port", int), ("rank_offset", int), ("world_size", int)):
            if not isinstance(body.get(key), kind):
                raise BadRequest(f"{key}: missing or not {kind.__name__}")
        name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            return 400, {"success": False, "message": "Failed to initialize custom process group: no CUDA device."}
        rank = body["rank_offset"] + 0  # + tp_rank
        try:
            timeout = datetime.timedelta(seconds=60)
            url = f"tcp://{body['master_address']}:{body['master_port']}"
            store, _, _ = next(c10d.rendezvous(url, rank, body["world_size"], timeout=timeout))
            store.set_timeout(timeout)
            store = c10d.PrefixStore(name, store)
            pg, _ = c10d._new_process_group_helper(
                body["world_size"], rank, [], c10d.Backend(backend), store, group_name=name, timeout=timeout
            )
            c10d._world.pg_group_ranks[pg] = {i: i for i in range(body["world_size"])}
        except Exception as e:
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {e}."}
        self.groups[name] = pg
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict) -> tuple[int, dict]:
        import torch.distributed as dist

        pg = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(pg)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def begin(self, body: dict) -> tuple[int, dict]:
        if self.session:
            return 400, {"success": False, "message": "a weight-update session is already open"}
        self.session = True
        return 200, {"success": True, "message": "Success"}

    def end(self, body: dict) -> tuple[int, dict]:
        if not self.session:
            return 400, {"success": False, "message": "no weight-update session is open"}
        self.session = False
        return 200, {"success": True, "message": "Success"}

    def update_distributed(self, body: dict) -> tuple[int, dict]:
        import torch.distributed as dist

        if not self.session:
            msg = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            return 400, {"success": False, "message": msg}
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise BadRequest("names, dtypes and shapes are required lists")
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return 400, {"success": False, "message": f"Group {name} not in {list(self.groups)}"}
        pg = self.groups[name]
        specs = [(n, getattr(torch, d), torch.Size(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        with self._lock:  # the writer lock: no generation while weights change
            weights: dict[str, torch.Tensor] = {}
            if body.get("load_format") == "flattened_bucket":
                sizes = [sh.numel() * torch.empty((), dtype=dt).element_size() for _, dt, sh in specs]
                flat = torch.empty(sum(sizes), dtype=torch.uint8)
                dist.broadcast(flat, src=0, group=pg)
                at = 0
                for (n, dt, sh), size in zip(specs, sizes, strict=True):
                    weights[n] = flat[at : at + size].view(dt).reshape(sh)
                    at += size
            else:
                for n, dt, sh in specs:
                    weights[n] = torch.empty(sh, dtype=dt)
                    dist.broadcast(weights[n], src=0, group=pg)
            params = self.model.state_dict()
            unknown = [n for n in weights if n not in params]
            if unknown:
                return 400, {"success": False, "message": f"Failed to update parameter online: unknown {unknown}"}
            self.model.load_state_dict(weights, strict=False)
            if body.get("weight_version") is not None:
                self.weight_version = self.scheduler_version = str(body["weight_version"])
                self.paused.serving(self.scheduler_version)
            if body.get("flush_cache", True):
                self.cache_flushes += 1
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def weights_by_name(self, body: dict) -> tuple[int, Any]:
        """SGLang's ``/get_weights_by_name``: the parameter's first ``truncate_size`` rows, as nested lists."""
        param = dict(self.model.named_parameters()).get(str(body.get("name")))
        if param is None:
            return 400, {"error": {"message": f"no parameter {body.get('name')!r}"}}
        with self._lock:
            return 200, param.detach()[: int(body.get("truncate_size", 100))].float().tolist()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any) -> None:
                text = isinstance(body, str)  # /flush_cache answers in plain text
                raw = body.encode() if text else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                if self.path in ("/health", "/ready"):
                    self._reply(200, {})
                elif self.path == "/model_info":
                    self._reply(200, {"model_path": standin.model_path, "weight_version": standin.weight_version})
                elif self.path == "/server_info":
                    lora = standin.adapters.server_info() if standin.adapters else {"enable_lora": None}
                    self._reply(200, {"model_path": standin.model_path, "tp_size": 1, "dp_size": 1, **lora})
                else:
                    self._reply(404, {"error": self.path})

            def do_POST(self) -> None:
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                except json.JSONDecodeError as e:
                    self._reply(400, {"error": f"not JSON: {e}"})
                    return
                standin.requests.append((self.path, body))
                path, _, query = self.path.partition("?")
                try:
                    if path == "/flush_cache":
                        self._reply(*standin.flush_cache(urllib.parse.parse_qs(query)))
                    elif path == "/update_weight_version":
                        self._reply(*standin.update_weight_version(body))
                    elif self.path == "/generate":
                        self._reply(200, standin.generate(body))
                    elif self.path == "/update_weights_from_disk":
                        self._reply(*standin.update_weights(body))
                    elif self.path == "/get_weights_by_name":
                        self._reply(*standin.weights_by_name(body))
                    elif self.path in ("/load_lora_adapter", "/unload_lora_adapter"):
                        self._reply(*standin.lora_call(self.path, body))
                    elif self.path in standin.control:
                        self._reply(*standin.control[self.path](body))
                    else:
                        self._reply(404, {"error": self.path})
                except (BadRequest, LoraError) as e:
                    self._reply(400, {"error": {"message": str(e)}})
                except IndexError:  # a lora_path list shorter than the batch: the real server's 500
                    self._reply(500, "Internal Server Error")

        return Handler


def main() -> None:
    p = argparse.ArgumentParser(description="a SGLang stand-in for tests")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--busy-s", type=float, default=0.0, help="seconds the scheduler stays busy after a /generate")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=0)
    p.add_argument("--lora-target-modules", nargs="*", default=[])
    p.add_argument("--max-loaded-loras", type=int, default=None)  # SGLang's default: no cap
    args, _unknown = p.parse_known_args()  # like launch_server's other options, ignored
    lora = (args.max_lora_rank, args.lora_target_modules, args.max_loaded_loras) if args.enable_lora else None
    server = StandIn(args.model_path, args.host, args.port, args.weight_version, args.busy_s, lora)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
