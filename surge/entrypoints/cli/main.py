"""The `surge` command: serve, generate, chat, model-path, preset-dir, bench, weight-cache, kv-store.

Heavy imports (torch, transformers) happen inside the subcommands, so `surge --help` answers at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from surge.engine.args import EngineArgs
from surge.entrypoints.cli.args import add_sampling_args, sampling_params


def cmd_model_path(args: argparse.Namespace) -> int:
    from surge.model.loader.default_model import default_model_path
    print(default_model_path())
    return 0


def cmd_preset_dir(args: argparse.Namespace) -> int:
    from surge.model.loader.preset_dir import write_preset_dir
    print(write_preset_dir(args.preset, args.out_dir))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from surge import LLM
    params = sampling_params(args)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("surge generate: give at least one prompt (argument or stdin)", file=sys.stderr)
        return 2
    for out in llm.generate(prompts, params):
        for c in out.outputs:
            prefix = f"[{out.request_id}.{c.index}] " if len(prompts) > 1 or len(out.outputs) > 1 else ""
            print(f"{prefix}{c.text}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from surge import LLM
    params = sampling_params(args)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    conversation = [{"role": "system", "content": args.system}] if args.system else []

    def reply(text: str) -> str:
        conversation.append({"role": "user", "content": text})
        answer = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
        conversation.append({"role": "assistant", "content": answer})
        return answer

    if args.message:
        print(reply(args.message))
        return 0
    print("surge chat: type a message, an empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            break
        if not text.strip():
            break
        print(reply(text))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from surge import envs
    from surge.entrypoints.openai.app import run_server
    from surge.entrypoints.openai.lora import parse_lora_modules
    from surge.entrypoints.openai.options import ServerOptions
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    run_server(EngineArgs.from_cli_args(args), host=args.host, port=args.port,
               api_key=args.api_key or envs.SURGE_API_KEY, served_model_names=args.served_model_name,
               log_level=args.log_level, access_log=not args.no_access_log, metrics_prefix=args.metrics_prefix,
               options=ServerOptions.from_cli_args(args), lora_modules=lora_modules)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from surge.bench.serve import run_serve_bench
    run_serve_bench(args)
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from surge.bench.throughput import run_throughput
    run_throughput(args)
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from surge.bench.latency import run_latency
    run_latency(args)
    return 0


def cmd_bench_embed(args: argparse.Namespace) -> int:
    from surge.bench.embed import run_embed
    run_embed(args)
    return 0


def cmd_bench_parity(args: argparse.Namespace) -> int:
    from surge.bench.parity import run_parity
    return run_parity(args)


def cmd_bench_startup(args: argparse.Namespace) -> int:
    from surge.bench.startup import run_startup
    return run_startup(args)


def cmd_bench_prefix_reuse(args: argparse.Namespace) -> int:
    from surge.bench.prefix_reuse import run_prefix_reuse
    run_prefix_reuse(args)
    return 0


def cmd_bench_structured(args: argparse.Namespace) -> int:
    from surge.bench.structured import run_structured
    run_structured(args)
    return 0


def cmd_bench_proxy(args: argparse.Namespace) -> int:
    from surge.bench.proxy import cli
    return cli(args)


def cmd_proxy(args: argparse.Namespace) -> int:
    from surge.disagg.proxy import run_proxy
    run_proxy(args.prefill, args.decode, args.host, args.port, timeout_s=args.timeout, log_level=args.log_level,
              encode=args.encode)
    return 0


def cmd_weight_cache_serve(args: argparse.Namespace) -> int:
    from surge.weight_cache.launcher import serve
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.load_format not in ("auto", "safetensors"):
        raise ValueError(f"--load-format={engine_args.load_format}: the daemons load the checkpoint itself (auto or "
                         "safetensors)")
    return serve(engine_args.create_engine_config(), args.weight_cache_dir, args.weight_cache_master_port,
                 args.health_host, args.health_port)


def cmd_kv_store_serve(args: argparse.Namespace) -> int:
    from surge.kv_transfer.mooncake_server import serve
    return serve(args.rpc_port, args.metadata_port, args.segment_gib, args.log_dir)


def run_headless_node(args: argparse.Namespace) -> int:
    """--node-rank > 0: whatever the subcommand, this node only runs its ranks for node 0's engine."""
    from surge.worker.executor import run_headless
    # The bench subcommands' --preset and --enforce-eager come along: the same random-weight model as node 0, and
    # CUDA graphs that match node 0's.
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.preset:
        engine_args = dataclasses.replace(engine_args, model=None, load_format="dummy")
    return run_headless(engine_args.create_engine_config())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="surge", description="Surge: a compact, fast LLM inference engine")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (completions, chat, responses)")
    EngineArgs.add_cli_args(p, model_positional=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $SURGE_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use for the model (default: the model argument)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    g.add_argument("--no-access-log", action="store_true", help="do not log each HTTP request")
    g.add_argument("--metrics-prefix", default="surge", help="prefix of the /metrics names (default: surge); "
                   "'vllm' gives vLLM's exact names, for its dashboards and alerts")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served under their name (a request's model), as name=path or JSON "
                   "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; needs --enable-lora")
    from surge.entrypoints.openai.options import ServerOptions
    ServerOptions.add_cli_args(p)
    p.set_defaults(func=cmd_serve, cuda_graph_capture="background")  # the engine core's process runs only it

    p = sub.add_parser("model-path", help="print the default model's directory (preparing it if needed)")
    p.set_defaults(func=cmd_model_path)

    p = sub.add_parser("preset-dir", help="write a vision-language preset as a model directory without weights (its "
                       "config, image processor and a synthetic tokenizer with its special tokens and chat template),"
                       " to serve with --load-format dummy")
    p.add_argument("preset", help="e.g. qwen2.5-vl-7b")
    p.add_argument("out_dir", help="the directory to write (one this command wrote before is replaced)")
    p.set_defaults(func=cmd_preset_dir)

    p = sub.add_parser("generate", help="complete prompts")
    p.add_argument("prompt", nargs="*", help="prompts (default: one per line on stdin)")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model: interactive, or one-shot with a message")
    p.add_argument("message", nargs="?", default=None, help="one message to answer, then exit")
    p.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from surge.bench.throughput import add_throughput_args
    p = bench.add_parser("throughput", help="offline throughput on random-token prompts")
    EngineArgs.add_cli_args(p)
    add_throughput_args(p)
    p.set_defaults(func=cmd_bench_throughput)
    from surge.bench.latency import add_latency_args
    p = bench.add_parser("latency", help="prefill and per-token decode latency, with GB/s, MBU, TFLOP/s and MFU")
    EngineArgs.add_cli_args(p)
    add_latency_args(p)
    p.set_defaults(func=cmd_bench_latency)
    from surge.bench.embed import add_embed_args
    p = bench.add_parser("embed", help="embedding throughput of the pooling runner (texts/s, tok/s, TFLOP/s, MFU) "
                         "beside sentence-transformers on the same inputs")
    EngineArgs.add_cli_args(p)
    add_embed_args(p)
    # The peer holds a second copy of the weights on the same device: the KV cache leaves room for it.
    p.set_defaults(func=cmd_bench_embed, runner="pooling", memory_fraction=0.5)
    from surge.bench.parity import add_parity_args
    p = bench.add_parser("parity", help="greedy output against HF transformers on the same weights, with where "
                         "and by how much they part")
    EngineArgs.add_cli_args(p)
    add_parity_args(p)
    p.set_defaults(func=cmd_bench_parity)
    from surge.bench.startup import add_startup_args
    p = bench.add_parser("startup", help="cold start (disk) against warm start (weight-cache daemon): weight-load "
                         "seconds and time from process start to first token")
    EngineArgs.add_cli_args(p)
    add_startup_args(p)
    p.set_defaults(func=cmd_bench_startup, cuda_graph_capture="background")  # the restart of a server
    from surge.bench.prefix_reuse import add_prefix_reuse_args
    p = bench.add_parser("prefix-reuse", help="requests sharing a long prefix: cold, local prefix caching, the "
                         "offload tier after eviction, the Mooncake store after a restart; TTFT side by side")
    EngineArgs.add_cli_args(p)
    add_prefix_reuse_args(p)
    p.set_defaults(func=cmd_bench_prefix_reuse)
    from surge.bench.structured import add_structured_args
    p = bench.add_parser("structured", help="the cost of grammar masks: batch decode with and without a JSON "
                         "schema in one run, per output token and their ratio")
    EngineArgs.add_cli_args(p)
    add_structured_args(p)
    p.set_defaults(func=cmd_bench_structured)
    from surge.bench.serve import add_serve_bench_args
    p = bench.add_parser("serve", help="online benchmark against any OpenAI-compatible server")
    add_serve_bench_args(p)
    p.set_defaults(func=cmd_bench_serve)
    from surge.bench.proxy import add_proxy_bench_args
    p = bench.add_parser("proxy", help="the disaggregation proxy's requests/s and added latency against stub "
                         "upstreams, beside a proxy that parses and re-encodes every body")
    add_proxy_bench_args(p)
    p.set_defaults(func=cmd_bench_proxy)

    weight_cache = sub.add_parser("weight-cache", help="Fast Start: daemons that keep loaded weights for new "
                                  "engines").add_subparsers(dest="weight_cache_command", required=True)
    p = weight_cache.add_parser("serve", help="one launcher per node: a daemon per local device (per rank on CPU) "
                                "loads its shard and serves it on a Unix socket until SIGTERM")
    EngineArgs.add_cli_args(p, model_positional=True)
    g = p.add_argument_group("weight-cache daemons")
    g.add_argument("--weight-cache-master-port", type=int, default=None, help="the daemons' own rendezvous port on "
                   "--master-addr (required with --nnodes > 1; never the engine's --master-port)")
    g.add_argument("--health-port", type=int, default=None, help="serve GET /health here: 200 when every local "
                   "daemon is ready, 503 otherwise")
    g.add_argument("--health-host", default="127.0.0.1", help="address of the /health endpoint")
    p.set_defaults(func=cmd_weight_cache_serve)

    kv_store = sub.add_parser("kv-store", help="a Mooncake store that keeps KV blocks across engine restarts and "
                              "instances").add_subparsers(dest="kv_store_command", required=True)
    p = kv_store.add_parser("serve", help="start its master, metadata server and memory on 127.0.0.1 until SIGTERM; "
                            "prints the engines' --kv-transfer-config")
    p.add_argument("--rpc-port", type=int, default=50051, help="the master's RPC port (the connector's \"master\")")
    p.add_argument("--metadata-port", type=int, default=8080, help="the HTTP metadata server's port")
    p.add_argument("--segment-gib", type=float, default=4.0, help="KV memory the store holds, in GiB")
    p.add_argument("--log-dir", default=None, help="where the store's processes log (default: a new temp dir)")
    p.set_defaults(func=cmd_kv_store_serve)

    p = sub.add_parser("proxy", help="encoder/prefill/decode disaggregation: an OpenAI-compatible front that sends "
                       "a request's images to an encoder instance, its prefill leg to a prefill instance and its "
                       "decode leg to a decode instance")
    p.add_argument("--encode", nargs="+", action="extend", default=[], metavar="URL",
                   help="encoder instances (surge serve with an ec_producer --ec-transfer-config): requests with "
                   "images go to one first; if none can take one, the prefill instance encodes its images")
    p.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill instances (surge serve with a kv_producer MooncakeTransferConnector); none: "
                   "plain least-outstanding balancing over the --decode instances")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                   help="decode instances (surge serve with a kv_consumer MooncakeTransferConnector)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer a leg")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_proxy)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from surge.version import __version__
        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "node_rank", 0) > 0 and args.command != "weight-cache":  # daemons serve every node
            return run_headless_node(args)
        return args.func(args)
    except ValueError as e:
        print(f"surge {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
