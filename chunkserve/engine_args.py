"""The engine's command-line flags (vLLM's names) and the ``EngineConfig`` they make:
shared by every command that builds an engine (generate, serve, profile, simulate)."""

from __future__ import annotations

import argparse

from chunkserve.config import ATTENTION_BACKENDS, EngineConfig


def parse_bytes(text: str) -> int:
    """``1073741824``, ``512MiB``, ``2GiB``, ``1.5G`` -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if s and s[-1] in units:
            return int(float(s[:-1]) * units[s[-1]])
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser, sampler_seed: bool = True) -> None:
    """Engine flags, named as vLLM names them (SGLang's spelling accepted where noted)."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="a .gguf file or an HF directory (default: embedded SmolLM2-135M)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (tokenizer.json)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes for the KV cache (e.g. 1GiB); default 1 GiB on CPU",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step: given alone, every step has it (static); with "
        "--max-decode-slowdown, --long-step-share or --itl-slo-ms, the most an adaptive step "
        "carries (default: "
        "adaptive, cap min(8192, max-model-len); 512 with chunking off)",
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="SGLang's name for the budget; -1 disables chunked prefill",
    )
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="whole prompts in prefill-only steps (decodes stall): the baseline",
    )
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument(
        "--prefill-order",
        default="shortest",
        choices=["shortest", "arrival"],
        help="how a step's prefill share is handed out: shortest (default; prefills in "
        "progress move a block each, then the prompts with least left, aged by their wait) "
        "or arrival (policy order)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV of shared prompt prefixes (default: on)",
    )
    g.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=0,
        help="most prompts mid-prefill at once (0: no limit)",
    )
    g.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=1,
        help="most long prompts mid-prefill at once; short ones start first (0: no limit)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="prompts with more tokens left are long: at most this many tokens and half the "
        "budget per step before short ones start (default 4%% of max-model-len; 0: off)",
    )
    g.add_argument(
        "--max-decode-slowdown",
        type=float,
        default=None,
        help="adaptive budget (the default, 2.0): a step that carries prefill may take at "
        "most this many times as long as its decodes alone, unless the measured prefill load "
        "needs more (with --max-num-batched-tokens: the cap)",
    )

    g.add_argument(
        "--long-step-share",
        type=float,
        default=None,
        help="adaptive budget (default 0.005): the share of token gaps that long steps may "
        "take, each prefilling waiting prompts whole that no step under the slowdown fits, "
        "in one step of up to 25x the step's fixed cost; 0: never (named, the budget is "
        "adaptive; with --max-num-batched-tokens: the cap)",
    )
    g.add_argument(
        "--itl-slo-ms",
        type=float,
        default=None,
        help="inter-token latency target: choose each step's budget online to stay under it",
    )
    g.add_argument(
        "--cost-profile",
        default=None,
        help="cost model JSON from `chunkserve profile` (with an adaptive budget, the "
        "default: the saved one, if any); every step's prediction is logged and exported "
        "beside its time",
    )
    g.add_argument(
        "--schedule-conservativeness",
        type=float,
        default=1.0,
        help="KV room kept for running requests' outputs when admitting (SGLang's flag)",
    )
    if sampler_seed:
        g.add_argument("--seed", type=int, default=0, help="sampler seed of unseeded requests")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS))
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights of the model's shapes (benchmarks; no weight files needed)",
    )
    g.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs (CUDA only)")
    g.add_argument(
        "--no-fused-ops",
        dest="fused_ops",
        action="store_false",
        help="plain torch ops instead of the fused Triton norm/rotary/SiLU kernels (CUDA only)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON (vLLM\'s form): {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}; also '
        '"disable_by_batch_size", "min_acceptance_rate"',
    )
    g.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        help="split the model over this many processes (torch.distributed: gloo on CPU, NCCL "
        "on CUDA); on CPU each takes --num-threads (default: the cores / ranks on the node)",
    )
    g.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes the tensor-parallel ranks span (MASTER_ADDR/MASTER_PORT name node 0)",
    )
    g.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index: 0 serves, the others run their ranks headless",
    )
    g.add_argument(
        "--no-tensor-parallel-shm",
        dest="tensor_parallel_shm",
        action="store_false",
        help="tensor-parallel ranks on one CPU host sum over gloo instead of shared memory",
    )
    g.add_argument(
        "--disaggregation-mode",
        choices=["prefill", "decode"],
        default=None,
        help="prefill/decode disaggregation: 'prefill' computes prompts' KV and sends it to "
        "the decode instance that asked; 'decode' receives it and samples every token "
        "(put `chunkserve router` in front)",
    )
    g.add_argument(
        "--kv-connector",
        choices=["shm", "torch"],
        default="shm",
        help="decode side: how KV blocks arrive: shared memory (one host, the default) or "
        "torch.distributed point-to-point (separate hosts)",
    )
    g.add_argument(
        "--kv-transfer-host",
        default="127.0.0.1",
        help="--kv-connector torch: the address this decode instance listens on",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument(
        "--decode-log-interval",
        type=int,
        default=20,
        help="decode-only steps summed into one info line (1: a line per step)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    budget = args.max_num_batched_tokens
    chunked = not args.no_chunked_prefill
    if args.chunked_prefill_size is not None:
        if args.chunked_prefill_size == -1:
            chunked = False
        elif budget is not None and budget != args.chunked_prefill_size:
            raise ValueError("--chunked-prefill-size and --max-num-batched-tokens disagree")
        else:
            budget = args.chunked_prefill_size
    kwargs = dict(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=chunked,
        scheduling_policy=args.scheduling_policy,
        prefill_order=args.prefill_order,
        schedule_conservativeness=args.schedule_conservativeness,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        itl_slo_ms=args.itl_slo_ms,
        max_decode_slowdown=args.max_decode_slowdown,
        long_step_share=args.long_step_share,
        cost_profile=args.cost_profile,
        seed=getattr(args, "seed", 0),
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        fused_ops=args.fused_ops,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        tensor_parallel_shm=args.tensor_parallel_shm,
        disaggregation_mode=args.disaggregation_mode,
        kv_connector=args.kv_connector,
        kv_transfer_host=args.kv_transfer_host,
        log_stats_interval=args.decode_log_interval,
    )
    kwargs["max_num_batched_tokens"] = budget
    return EngineConfig(**kwargs)
