"""The `ddserve` command. Each subcommand's work lives in its own module; this file only parses."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from ddserve.engine.config import EngineConfig

_ENGINE = EngineConfig()  # the defaults `generate` passes and `serve` inherits (no torch import)


def _make_tiny(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny",
        help="write a small random checkpoint of this architecture (for tests)",
        description="Write a small HF-format DeepSeek-V3/Kimi-K2 checkpoint (config.json, "
        "safetensors, tokenizer) with random weights, plus a matching tiny DFlash drafter under "
        "OUT/drafter. Deterministic from --seed.",
    )
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--int4", action="store_true", help="routed experts as compressed-tensors INT4")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(run="ddserve.model.tiny:main")


def _generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text offline (no server), with or without DDTree",
        description="Offline generation through the same engine the server uses.",
    )
    p.add_argument("--model", default=None,
                   help="checkpoint dir (default: the embedded ddserve-code-21m)")  # fmt: skip
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter directory (default: the checkpoint's own drafter/ "
                   "when it has one, as the embedded model does; else autoregressive)")  # fmt: skip
    p.add_argument("--prompt", action="append", required=True, help="prompt; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--budget", type=int, default=_ENGINE.budget,
                   help="DDTree node budget per step (default %(default)s)")  # fmt: skip
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo on CPU)")
    p.add_argument("--no-speculative", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode/verify forwards from CUDA graphs (pays off for long "
                   "runs)")  # fmt: skip
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                   help="batch-invariant GPU kernels: DDTree == plain decoding bit for bit "
                   "(default: on)")  # fmt: skip
    p.set_defaults(run="ddserve.engine.llm:main")


def _serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API (Ray Serve)",
        description="Start a private local Ray (or join --address) and serve /v1/completions, "
        "/v1/chat/completions, /v1/models, /health and /metrics. With no --model, serves the "
        "embedded ddserve-code-21m and its drafter (tp=2 on CPU so the distributed path runs). "
        "The deployment is checked first (paths, tp, resources, the HTTP port): an impossible "
        "one exits with status 2 and its cause. Ctrl-C or SIGTERM stops the server and the "
        "Ray it started. The local Ray listens on 127.0.0.1 only; only --host:--port is meant "
        "to be reached.",
    )
    p.add_argument("--model", default=None,
                   help="checkpoint dir (default: the embedded ddserve-code-21m)")  # fmt: skip
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter directory (default: the checkpoint's own drafter/ when it "
                   "has one, as the embedded model does)")  # fmt: skip
    p.add_argument("--tp", type=int, default=None,
                   help="TP ranks (default: 2 on CPU, every GPU of one node); must shard the model "
                   "(heads, vocabulary, expert widths in whole INT4 groups)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1",
                   help="HTTP address (default 127.0.0.1: this machine only; 0.0.0.0 serves "
                   "every interface: set --api-key, put a TLS proxy in front)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (/health stays open; default: "
                   "$DDSERVE_API_KEY, which keeps the key out of the process list)")  # fmt: skip
    p.add_argument("--max-streams", type=int, default=None, help="concurrent streams (default 10)")
    p.add_argument("--budget", type=int, default=None,
                   help=f"DDTree nodes per stream per step ({_ENGINE.budget})")  # fmt: skip
    p.add_argument("--buckets", type=_ints, default=None,
                   help="batch sizes streams are padded to, e.g. 1,2,4,8,12,16")  # fmt: skip
    p.add_argument("--budgets", type=_ints_or_auto, default=None,
                   help="one tree budget per bucket, or 'auto' to choose each batch size's budget "
                   "online by measured tokens/s (default: --budget for all)")  # fmt: skip
    p.add_argument("--num-slots", type=int, default=None,
                   help=f"KV cache size in tokens, per replica (default "
                   f"{_ENGINE.num_slots})")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=None,
                   help="waiting requests before 429 (default 64)")  # fmt: skip
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default=None,
                   help="compute dtype (auto: bf16 on GPU, float32 on CPU)")  # fmt: skip
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    p.add_argument("--served-model-name", default=None,
                   help="name clients use (default: the checkpoint directory's name)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None,
                   help="base seed of unseeded requests (default: drawn at start-up)")  # fmt: skip
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode/verify forwards from CUDA graphs (default: on with "
                   "CUDA devices and a 16-bit dtype)")  # fmt: skip
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant GPU kernels, so speculative output equals plain decoding "
                   "bit for bit in bf16 (default: on)")  # fmt: skip
    p.add_argument("--no-speculative", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run every step shape once (compile kernels, capture CUDA graphs) before "
                   "serving (default: on)")  # fmt: skip
    p.add_argument("--pipeline", type=int, default=None, metavar="N",
                   help="steps in flight from the router to the shards: 2 sends the next step "
                   "while the shards run this one, hiding the Ray round trip; 1 waits for each "
                   "step's result (default 2)")  # fmt: skip
    p.add_argument("--address", default=None,
                   help="join this Ray cluster (default: start a private local Ray, stopped with "
                   "the server)")  # fmt: skip
    p.set_defaults(run="ddserve.serve.main:main")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _ints_or_auto(text: str) -> list[int] | str:
    return "auto" if text.strip() == "auto" else _ints(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddserve",
        description="Serve DeepSeek-V3-architecture MoE models with DDTree speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_make_tiny, _generate, _serve):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if importlib.util.find_spec("torch") is None:  # every command runs the model
        print(f"ddserve: PyTorch is not installed in this Python ({sys.executable}). Install it "
              "first (on a CPU machine: pip install torch==2.13.0; see the README), then run "
              "the command again.", file=sys.stderr)  # fmt: skip
        return 2
    module, func = args.run.split(":")
    target = getattr(__import__(module, fromlist=[func]), func)
    return int(target(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
