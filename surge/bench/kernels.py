"""GPU check and microbenchmark of every Surge kernel at Qwen3-8B shapes (the fused MoE at Qwen3-30B-A3B's; the
quantized GEMMs beside bf16 cuBLAS and torch._scaled_mm):
`python -m surge.bench.kernels`.
Each line: the case, its time, what it achieved (GB/s; TFLOP/s for prefill attention), its check against torch.
"""
# The ceilings to read the numbers against are measured in the same run. The sampler's figure (256 rows, top-k 50,
# top-p 0.9) also times the torch path on the same logits and noise, and says whether the kernel meets 0.25 ms.
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import torch

from surge.bench.paged_blocks import scattered_blocks

HQ, HKV, HEAD_DIM, HIDDEN, INTERMEDIATE, VOCAB = 32, 8, 128, 4096, 12288, 151936
DTYPE = torch.bfloat16
failures: list[str] = []


def bench(fn) -> float:
    """Median seconds of fn, replayed from a CUDA graph when it can be captured (no launch overhead)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    try:
        ms = triton.testing.do_bench_cudagraph(fn, rep=50)
    except Exception:  # noqa: BLE001 - anything that cannot be captured is timed eagerly
        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
    return ms * 1e-3


def report(name: str, seconds: float, nbytes: float = 0.0, flops: float = 0.0, err: float | None = None,
           tol: float = 0.0, extra: str = "") -> None:
    parts = [f"{name:<40}", f"{seconds * 1e6:9.1f} us"]
    if nbytes:
        parts.append(f"{nbytes / seconds / 1e9:7.0f} GB/s")
    if flops:
        parts.append(f"{flops / seconds / 1e12:6.1f} TFLOP/s")
    if err is not None:
        ok = err <= tol
        parts.append(f"err {err:.1e} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(name)
    if extra:
        parts.append(extra)
    print("  ".join(parts), flush=True)


def max_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |got - expected| / (1 + |expected|): absolute near zero, relative (bf16 ulps) for large values."""
    if got.isnan().any() != expected.isnan().any():
        return math.inf
    got, expected = got.float(), expected.float()
    return ((got - expected).abs() / (1 + expected.abs())).max().item()


def ceilings() -> None:
    """The limits to read the numbers against: device-to-device copy (bytes read + written) and a bf16 GEMM."""
    src = torch.empty(1 << 30, dtype=torch.float32, device="cuda")  # 4 GiB: far beyond L2
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        dst.copy_(src)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    copy_s = start.elapsed_time(end) / 5 * 1e-3
    del src, dst
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    gemm_s = bench(lambda: a @ a)
    print(f"# {torch.cuda.get_device_name()}  copy {2 * 4 * (1 << 30) / copy_s / 1e9:.0f} GB/s  "
          f"bf16 GEMM {2 * 8192 ** 3 / gemm_s / 1e12:.0f} TFLOP/s  (torch {torch.__version__})", flush=True)


def check_norm_rotary_activation() -> None:
    from surge.kernels.activation import silu_and_mul
    from surge.kernels.norm import fused_add_rms_norm, rms_norm
    from surge.kernels.rotary import apply_rotary
    from surge.model.layers.activation import SiluAndMul
    from surge.model.layers.norm import RMSNorm
    from surge.model.layers.rotary import RotaryEmbedding

    norm = RMSNorm(HIDDEN).to("cuda", DTYPE)
    norm.weight.data.normal_()
    rope = RotaryEmbedding(HEAD_DIM, 40960, {"rope_theta": 1e6, "rope_type": "default"}).to("cuda")
    for t in (1, 256, 8192):
        x = torch.randn(t, HIDDEN, device="cuda", dtype=DTYPE)
        r = torch.randn_like(x)
        tt = bench(lambda: norm(x))
        report(f"rms_norm T={t}", bench(lambda: rms_norm(x, norm.weight, norm.eps)), nbytes=2 * x.numel() * 2,
               err=max_err(rms_norm(x, norm.weight, norm.eps), norm(x)), tol=0.02, extra=f"torch {tt * 1e6:.1f} us")
        out, res = fused_add_rms_norm(x, r, norm.weight, norm.eps)
        ref, ref_res = norm(x, r)
        tt = bench(lambda: norm(x, r))
        report(f"fused_add_rms_norm T={t}", bench(lambda: fused_add_rms_norm(x, r, norm.weight, norm.eps)),
               nbytes=4 * x.numel() * 2, err=max(max_err(out, ref), max_err(res, ref_res)), tol=0.02,
               extra=f"torch {tt * 1e6:.1f} us")

        qkv = torch.randn(t, (HQ + 2 * HKV) * HEAD_DIM, device="cuda", dtype=DTYPE)
        q = qkv[:, :HQ * HEAD_DIM].view(t, HQ, HEAD_DIM)
        k = qkv[:, HQ * HEAD_DIM:(HQ + HKV) * HEAD_DIM].view(t, HKV, HEAD_DIM)
        pos = torch.randint(0, 40960, (t,), device="cuda")
        ref_q, ref_k = rope(pos, q.clone(), k.clone())
        qc, kc = q.clone(), k.clone()
        apply_rotary(pos, qc, kc, rope.cos_cache, rope.sin_cache)
        tt = bench(lambda: rope(pos, q, k))
        report(f"rotary T={t}", bench(lambda: apply_rotary(pos, q, k, rope.cos_cache, rope.sin_cache)),
               nbytes=2 * t * (HQ + HKV) * HEAD_DIM * 2 + 2 * t * HEAD_DIM * 2,
               err=max(max_err(qc, ref_q), max_err(kc, ref_k)), tol=0.02, extra=f"torch {tt * 1e6:.1f} us")

        gate_up = torch.randn(t, 2 * INTERMEDIATE, device="cuda", dtype=DTYPE)
        tt = bench(lambda: SiluAndMul()(gate_up))
        report(f"silu_and_mul T={t}", bench(lambda: silu_and_mul(gate_up)), nbytes=3 * t * INTERMEDIATE * 2,
               err=max_err(silu_and_mul(gate_up), SiluAndMul()(gate_up)), tol=0.02, extra=f"torch {tt * 1e6:.1f} us")


def _attention_batch(requests: list[tuple[int, int]], block_size: int = 16):
    """requests: (cached context, new tokens). A cache with scattered blocks; returns what the backends take."""
    from surge.attention.backend import AttentionMetadata

    num_blocks, table, slots, qsl = scattered_blocks(requests, block_size)
    cache = torch.randn(2, num_blocks, block_size, HKV, HEAD_DIM, device="cuda", dtype=DTYPE)
    t = qsl[-1]
    q = torch.randn(t, HQ, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(t, HKV, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    seq_lens = [c + n for c, n in requests]
    meta = AttentionMetadata(
        num_reqs=len(requests), num_tokens=t, query_start_loc=qsl, seq_lens=seq_lens,
        max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens),
        query_start_loc_t=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device="cuda"),
        slot_mapping=torch.cat(slots).cuda(), block_table=table.cuda())
    return q, k, v, cache, meta


def check_attention(quick: bool) -> None:
    from surge.attention.torch_backend import TorchAttentionBackend
    from surge.attention.triton_backend import TritonAttentionBackend
    from surge.kernels.kv_cache import write_kv_cache

    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    kernel = triton_backend.kernel(torch.device("cuda"))
    scale = HEAD_DIM ** -0.5
    # Warm-up as start-up would do it: every decode capture size plus the mixed launch, compiled in parallel.
    keys = [kernel.dispatch(decode_only=b > 0, num_seqs=max(b, 1), num_q_heads=HQ, num_kv_heads=HKV,
                            head_dim=HEAD_DIM, block_size=16, dtype=DTYPE, sliding=False)
            for b in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)]
    start = time.perf_counter()
    n = kernel.compile_many(keys)
    print(f"# attention warm-up: {len(set(keys))} distinct keys, {n} compiled in {time.perf_counter() - start:.1f} s "
          f"(parallel, <= 4 workers)", flush=True)

    for t in (256, 8192):
        k = torch.randn(t, HKV, HEAD_DIM, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        cache = torch.zeros(2, t // 16 + 1, 16, HKV, HEAD_DIM, device="cuda", dtype=DTYPE)
        slots = torch.randperm(t, device="cuda") + 16
        write_kv_cache(k, v, cache[0], cache[1], slots)
        flat = cache.view(2, -1, HKV, HEAD_DIM)
        err = max(max_err(flat[0, slots], k), max_err(flat[1, slots], v))
        report(f"kv_write T={t}", bench(lambda: write_kv_cache(k, v, cache[0], cache[1], slots)),
               nbytes=4 * k.numel() * 2, err=err, tol=0.0)

    batches = (1, 8, 64, 256) if quick else (1, 8, 32, 64, 128, 256)
    for b in batches:
        for ctx in (128, 1024, 4096):
            q, k, v, cache, meta = _attention_batch([(ctx - 1, 1)] * b)
            got = triton_backend.forward(q, k, v, cache, meta, None, scale)
            expected = torch_backend.forward(q, k, v, cache, meta, None, scale)
            launch = kernel.dispatch(decode_only=True, num_seqs=b, num_q_heads=HQ, num_kv_heads=HKV,
                                     head_dim=HEAD_DIM, block_size=16, dtype=DTYPE, sliding=False).launch
            kv_bytes = b * ctx * HKV * HEAD_DIM * 2 * 2
            report(f"attn decode b={b} ctx={ctx}", bench(lambda: triton_backend.forward(q, k, v, cache, meta, None,
                                                                                      scale)),
                   nbytes=kv_bytes + 2 * q.numel() * 2, err=max_err(got, expected), tol=0.02,
                   extra=f"splits={launch.num_splits}")
            del q, k, v, cache, meta, got, expected

    cases = [("prefill 8x2048", [(0, 2048)] * 8), ("prefill 1x2048 on 2048 cached", [(2048, 2048)]),
             ("mixed 64 decode@1024 + 512@1024", [(1023, 1)] * 64 + [(1024, 512)])]
    for name, requests in cases:
        q, k, v, cache, meta = _attention_batch(requests)
        got = triton_backend.forward(q, k, v, cache, meta, None, scale)
        expected = torch_backend.forward(q, k, v, cache, meta, None, scale)
        pairs = sum(sum(min(c + i + 1, c + n) for i in range(n)) for c, n in requests)  # visible (q, k) pairs
        report(f"attn {name}", bench(lambda: triton_backend.forward(q, k, v, cache, meta, None, scale)),
               flops=4 * pairs * HQ * HEAD_DIM, err=max_err(got, expected), tol=0.02)
    q, k, v, cache, meta = _attention_batch([(0, 2048)] * 2)
    got = triton_backend.forward(q, k, v, cache, meta, 512, scale)
    expected = torch_backend.forward(q, k, v, cache, meta, 512, scale)
    report("attn prefill 2x2048 window 512", bench(lambda: triton_backend.forward(q, k, v, cache, meta, 512, scale)),
           err=max_err(got, expected), tol=0.02)


def _peaked_logits(b: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A few clear favourites over a wide tail, as LLM logits mostly are."""
    logits = torch.randn(b, VOCAB, device="cuda") * 2
    logits.scatter_add_(1, torch.randint(0, VOCAB, (b, 16), device="cuda"), torch.rand(b, 16, device="cuda") * 6 + 10)
    return logits.to(dtype)


def check_sampling(quick: bool) -> None:
    from surge.kernels.sampling import TopKTopPSampler, sample_reference

    check_sampler_target()
    check_sampler_paths()
    sampler = TopKTopPSampler(torch.device("cuda"))
    modes = {"greedy": (0.0, 0, 1.0), "temperature 1": (1.0, 0, 1.0), "top_k 50": (1.0, 50, 1.0),
             "top_p 0.9": (1.0, 0, 0.9), "top_k 50 + top_p 0.95": (0.8, 50, 0.95)}
    for b in ((1, 256) if quick else (1, 64, 256)):
        # "flat": a wide Gaussian, where top-p keeps thousands of tokens; "very flat": its nucleus is wider than
        # the lanes' top 4 (the kernel's general path).
        for dist, logits in (("peaked", _peaked_logits(b)), ("flat", torch.randn(b, VOCAB, device="cuda") * 4),
                             ("very flat", torch.randn(b, VOCAB, device="cuda") * 0.5)):
            noise = torch.empty_like(logits).exponential_()
            for mode, (temp, k, p) in modes.items():
                if dist != "peaked" and mode in ("greedy", "temperature 1"):
                    continue
                temperature = torch.full((b,), temp, device="cuda")
                top_k = torch.full((b,), k, dtype=torch.int32, device="cuda")
                top_p = torch.full((b,), p, device="cuda")

                def run():
                    return sampler(logits, temperature, top_k, top_p, noise, max_batch=b, max_k=VOCAB)

                got = run()
                launch = sampler.dispatch(max_batch=b, vocab_size=VOCAB, max_k=VOCAB, dtype=logits.dtype).launch
                expected = sample_reference(logits, temperature, top_k, top_p, noise, launch.weight_bits)
                mismatches = int((got != expected).sum())
                nbytes = logits.numel() * 4 * (1 if temp == 0.0 else 2)
                report(f"sample b={b} {dist} {mode}", bench(run), nbytes=nbytes, err=float(mismatches), tol=0.0,
                       extra="(err: rows unlike the reference)")


def event_ms(fn, iters: int = 50, graph: bool = True) -> float:
    """Milliseconds per call between CUDA events around `iters` calls back to back: replayed from a CUDA graph (the
    device's time, without launch gaps), or called eagerly (graph=False: host work such as pinned copies)."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def check_sampler_paths() -> None:
    """The kernel against torch's path on the same peaked logits and noise, per batch size and filter: the figures
    the Sampler's per-batch choice rests on."""
    from surge.kernels.sampling import TopKTopPSampler
    from surge.model.layers.sampler import _apply_top_k_top_p

    kernel = TopKTopPSampler(torch.device("cuda"))
    modes = {"temperature 1": (0, 1.0), "top_k 50": (50, 1.0), "top_p 0.9": (0, 0.9), "top_k 50 + top_p 0.9": (50, 0.9)}
    for b in (1, 16, 64, 256):
        logits = _peaked_logits(b)
        noise = torch.empty_like(logits).exponential_()
        temperature = torch.full((b,), 0.8, device="cuda")
        for mode, (k, p) in modes.items():
            k_t = torch.full((b,), k, dtype=torch.int32, device="cuda")
            p_t = torch.full((b,), p, device="cuda")

            def with_torch():
                x = logits / temperature[:, None]
                if k or p < 1.0:
                    x = _apply_top_k_top_p(x, torch.where(k_t > 0, k_t, VOCAB).long(), p_t)
                return (x.softmax(dim=-1) / noise).argmax(dim=-1)

            kernel_ms = event_ms(lambda: kernel(logits, temperature, k_t, p_t, noise, max_batch=b, max_k=VOCAB))
            print(f"sampler paths b={b:<4} {mode:<22} triton {kernel_ms:.3f} ms   torch {event_ms(with_torch):.3f} ms",
                  flush=True)


TARGET_MS = 0.25  # issue 10: 256 rows, top_k=50, top_p=0.9, Qwen3-8B's vocabulary, on the H200


def check_sampler_target(rows: int = 256, top_k: int = 50, top_p: float = 0.9) -> None:
    """The Sampler's two paths on the same logits and noise: the Triton kernel against torch's
    (`_apply_top_k_top_p` + softmax + race), float32 and bfloat16 logits; then whole Sampler calls (noise drawn)."""
    from surge.kernels.sampling import TopKTopPSampler, launch_policy, sample_reference
    from surge.model.layers.sampler import Sampler, SamplingRow, _apply_top_k_top_p
    from surge.sampling_params import SamplingParams

    device = torch.device("cuda")
    kernel = TopKTopPSampler(device)
    temperature = torch.ones(rows, device=device)
    k_t = torch.full((rows,), top_k, dtype=torch.int32, device=device)
    p_t = torch.full((rows,), top_p, device=device)
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        logits = _peaked_logits(rows, dtype)
        noise = torch.empty(rows, VOCAB, device=device).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)

        def with_kernel(launch=None):
            return kernel(logits, temperature, k_t, p_t, noise, max_batch=rows, max_k=VOCAB, launch=launch)

        def with_torch():
            x = logits.float() / temperature[:, None]
            return (_apply_top_k_top_p(x, k_t.long(), p_t).softmax(dim=-1) / noise).argmax(dim=-1)

        policy = launch_policy(rows, VOCAB, VOCAB)
        got = with_kernel()
        exact = int((got != sample_reference(logits, temperature, k_t, p_t, noise, policy.weight_bits)).sum())
        same = int((got == with_torch()).sum())
        kernel_ms, torch_ms = event_ms(with_kernel), event_ms(with_torch)
        worst = max(worst, kernel_ms)
        nbytes = logits.numel() * logits.element_size()
        name = str(dtype).removeprefix("torch.")
        print(f"sampler {rows} rows top_k={top_k} top_p={top_p} V={VOCAB} {name:<8}  triton {kernel_ms:.3f} ms "
              f"{nbytes / kernel_ms / 1e6:6.0f} GB/s   torch {torch_ms:.3f} ms {nbytes / torch_ms / 1e6:6.0f} GB/s   "
              f"x{torch_ms / kernel_ms:.1f}   tokens: {exact} unlike the reference, {same}/{rows} as torch's",
              flush=True)
        if exact:
            failures.append(f"sampler target {name}")
        # Geometry alone (same tokens, other speed): the policy's choice beside its neighbours.
        for warps, stages in ((8, 2), (16, 1), (16, 3)):
            launch = dataclasses.replace(policy, num_warps=warps, num_stages=stages)
            same_tokens = torch.equal(with_kernel(launch), got)
            print(f"  geometry num_warps={warps} num_stages={stages}: {event_ms(lambda: with_kernel(launch)):.3f} ms"
                  f"{'' if same_tokens else '  TOKENS DIFFER'}  (policy: {policy.num_warps}, {policy.num_stages})",
                  flush=True)
            if not same_tokens:
                failures.append(f"sampler geometry {warps}/{stages}")
        sampler_rows = [SamplingRow(SamplingParams(top_k=top_k, top_p=top_p), [], [], None, 0) for _ in range(rows)]
        on_kernel, on_torch = Sampler(use_kernel=True), Sampler(use_kernel=False)
        on_kernel.warm_up(device, rows, VOCAB, dtype)
        on_kernel_ms = event_ms(lambda: on_kernel(logits, sampler_rows), graph=False)
        on_torch_ms = event_ms(lambda: on_torch(logits, sampler_rows), graph=False)
        print(f"  whole Sampler() call, noise drawn, eager: kernel path {on_kernel_ms:.3f} ms   torch path "
              f"{on_torch_ms:.3f} ms", flush=True)
    verdict = "holds" if worst <= TARGET_MS else "MISSED"
    print(f"# sampler target: {rows} rows, top_k={top_k}, top_p={top_p}, V={VOCAB}: the kernel takes at most "
          f"{worst:.3f} ms (float32, bfloat16) against {TARGET_MS} ms: {verdict}", flush=True)
    if worst > TARGET_MS:
        failures.append("sampler target")


def check_moe(device: str = "cuda", batches: tuple[int, ...] = (1, 8, 64, 256, 2048)) -> None:
    """Qwen3-30B-A3B's MoE block (128 experts, top 8, hidden 2048, intermediate 768), in its parts per batch size:
    the router (the fused kernel against torch's softmax, topk and renormalization), the block alignment (the Triton
    kernels against the torch ops), the experts (gate|up, down and combine on an alignment made beforehand), all of
    fused_moe, and router plus fused_moe (a layer's MoE work but the router GEMM). fused_moe is checked against the
    float32 torch reference (the CPU path, one GEMM pair per expert reached, also timed, eagerly); GB/s over the
    experts the batch reaches, TFLOP/s over the pairs. The router's err counts ids unlike a stable descending sort
    of the logits (its rule: ties to the lowest expert id), the alignment's entries unlike the torch alignment."""
    import triton.testing

    from surge.kernels.fused_moe import fused_moe, grouped_experts, launch_policy
    from surge.kernels.moe_routing import align_launch, align_to_blocks, route, router_launch
    from surge.kernels.reference import align_to_blocks as torch_align
    from surge.kernels.reference import fused_moe as torch_moe
    from surge.model.layers.moe import select_experts

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=DTYPE) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, device=device, dtype=DTYPE) / inter ** 0.5
    gate_up32, down32 = gate_up.float(), down.float()
    per_expert = 3 * hidden * inter * DTYPE.itemsize
    for tokens in batches:
        x = torch.randn(tokens, hidden, device=device, dtype=DTYPE)
        logits = torch.randn(tokens, experts, device=device).to(DTYPE)  # the router GEMM's output
        launch = launch_policy(tokens, top_k, experts, hidden, inter)

        weights, ids = route(logits, top_k, True, DTYPE)
        expected_ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
        torch_route = bench(lambda: select_experts(logits, top_k, True, DTYPE, use_kernel=False))
        report(f"moe router T={tokens} (rows/program {router_launch(tokens, experts, top_k).rows})",
               bench(lambda: route(logits, top_k, True, DTYPE)), err=float((ids.long() != expected_ids).sum()), tol=0.0,
               extra=f"torch path {torch_route * 1e6:.1f} us")

        aligned = align_to_blocks(ids, experts, launch.block_m)
        expected = torch_align(ids, experts, launch.block_m)
        mismatches = sum(int((a != b).sum()) for a, b in zip(aligned, expected, strict=True))
        torch_seconds = bench(lambda: torch_align(ids, experts, launch.block_m))
        programs = align_launch(tokens * top_k, experts, launch.block_m).num_programs
        report(f"moe align T={tokens} ({'1 launch' if programs == 1 else f'2 launches x {programs}'})",
               bench(lambda: align_to_blocks(ids, experts, launch.block_m)), err=float(mismatches), tol=0.0,
               extra=f"torch path {torch_seconds * 1e6:.1f} us")

        reached = ids.unique().numel()
        nbytes = reached * per_expert + tokens * (2 * hidden + top_k * (3 * inter + hidden)) * DTYPE.itemsize
        flops = 2 * tokens * top_k * 3 * hidden * inter
        report(f"moe experts T={tokens} ({reached} experts, block_m {launch.block_m})",
               bench(lambda: grouped_experts(x, gate_up, down, weights, ids, *aligned, launch)), nbytes=nbytes,
               flops=flops, extra="gate|up, down, combine")

        err = max_err(fused_moe(x, gate_up, down, weights, ids), torch_moe(x.float(), gate_up32, down32,
                                                                            weights.float(), ids))
        seconds = bench(lambda: fused_moe(x, gate_up, down, weights, ids))
        torch_seconds = triton.testing.do_bench(lambda: torch_moe(x, gate_up, down, weights, ids), rep=50) * 1e-3
        report(f"moe fused_moe T={tokens}", seconds, nbytes=nbytes, flops=flops, err=err, tol=2e-2,
               extra=f"torch path {torch_seconds * 1e6:.0f} us ({torch_seconds / seconds:.1f}x)")
        report(f"moe router+fused_moe T={tokens}",
               bench(lambda: fused_moe(x, gate_up, down, *route(logits, top_k, True, DTYPE))), nbytes=nbytes,
               extra="a layer's MoE block but the router GEMM")


LINEAR_SHAPES = {"o_proj": (HQ * HEAD_DIM, HIDDEN), "gate_up_proj": (2 * INTERMEDIATE, HIDDEN),
                 "down_proj": (HIDDEN, INTERMEDIATE)}


def _fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 [N, 1]) per output channel."""
    scale = (w.float().abs().amax(1, keepdim=True) / 448).clamp_min(1e-12)
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (multiples of 128) -> (fp8, float32 [N / 128, K / 128]): a checkpoint's weight_scale_inv."""
    n, k = w.shape
    blocks = w.float().view(n // 128, 128, k // 128, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)
    return (blocks / scale[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn), scale


def check_quant(batches: tuple[int, ...] = (1, 16, 256, 4096),
                shapes: dict[str, tuple[int, int]] | None = None) -> None:
    """Qwen3-8B's linear layers: bf16 cuBLAS beside W4A16 (group 128, asymmetric: the int GEMM), fp8 per token x
    per channel and fp8 1x128 x 128x128 blocks (torch._scaled_mm, with and without our activation quantization);
    then the activation quantization kernels alone. GB/s over the weight, activation and output bytes; each checked
    against the same math in float32 on the dequantized weight (fp8: on the quantized activations too)."""
    from surge.kernels import quant_reference as qref
    from surge.kernels.fp8_quant import (per_token_group_quant_fp8, scaled_fp8_quant_per_tensor,
                                         scaled_fp8_quant_per_token)
    from surge.kernels.int4_gemm import int_gemm, launch_policy

    for name, (n, k) in (shapes or LINEAR_SHAPES).items():
        w = torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5
        u = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
        packed = qref.pack_int32(u, 4)
        scale = (torch.rand(n, k // 128, device="cuda") * 0.02 + 0.001).to(DTYPE)
        zero = torch.randint(0, 16, (n, k // 128), device="cuda", dtype=torch.uint8)
        w_int = qref.dequantize_packed(packed, scale, 4, 128, zero)
        w_rows, s_rows = _fp8_rows(w)
        w_blocks, s_blocks = _fp8_blocks(w)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            io = (m * k + m * n) * 2
            flops = 2 * m * n * k
            tag = f"{name} {n}x{k} M={m}"
            bf16_s = bench(lambda: x @ w.t())
            report(f"bf16 cuBLAS {tag}", bf16_s, nbytes=n * k * 2 + io, flops=flops)

            got = int_gemm(x, packed, scale, bits=4, group_size=128, zero_point=zero)
            launch = launch_policy(m, n, k, 128, torch.cuda.get_device_properties(0).multi_processor_count)
            seconds = bench(lambda: int_gemm(x, packed, scale, bits=4, group_size=128, zero_point=zero))
            report(f"w4a16 int_gemm {tag}", seconds, nbytes=n * k // 2 + n * (k // 128) * 3 + io, flops=flops,
                   err=max_err(got, (x.float() @ w_int.float().t())), tol=2e-2,
                   extra=f"split_k={launch.split_k} x{bf16_s / seconds:.2f} of bf16")

            q, s = scaled_fp8_quant_per_token(x)
            expected = qref.dequantize_fp8(q, s) @ (w_rows.float() * s_rows).t()
            scale_b = s_rows.t()

            def rowwise():
                q, s = scaled_fp8_quant_per_token(x)
                return torch._scaled_mm(q, w_rows.t(), scale_a=s, scale_b=scale_b, out_dtype=DTYPE)

            gemm_s = bench(lambda: torch._scaled_mm(q, w_rows.t(), scale_a=s, scale_b=scale_b, out_dtype=DTYPE))
            seconds = bench(rowwise)
            report(f"fp8 per-token _scaled_mm {tag}", seconds, nbytes=n * k + io, flops=flops,
                   err=max_err(rowwise(), expected), tol=2e-2,
                   extra=f"GEMM alone {gemm_s * 1e6:.1f} us, x{bf16_s / seconds:.2f} of bf16")

            def blockwise():
                q, s = per_token_group_quant_fp8(x, 128)
                return torch._scaled_mm(q, w_blocks.t(), scale_a=s, scale_b=s_blocks.t(), out_dtype=DTYPE)

            try:
                q, s = per_token_group_quant_fp8(x, 128)
                expected = qref.dequantize_fp8(q, s, (1, 128)) @ qref.dequantize_fp8(w_blocks, s_blocks,
                                                                                     (128, 128)).t()
                err = max_err(blockwise(), expected)
                gemm_s = bench(lambda: torch._scaled_mm(q, w_blocks.t(), scale_a=s, scale_b=s_blocks.t(),
                                                        out_dtype=DTYPE))
                seconds = bench(blockwise)
                report(f"fp8 block _scaled_mm {tag}", seconds, nbytes=n * k + io, flops=flops, err=err, tol=2e-2,
                       extra=f"GEMM alone {gemm_s * 1e6:.1f} us, x{bf16_s / seconds:.2f} of bf16")
            except (RuntimeError, ValueError) as e:  # torch's blockwise scaled GEMM refuses some shapes and devices
                print(f"fp8 block _scaled_mm {tag}: not run: {str(e).splitlines()[0]}", flush=True)
            del x

    for m in batches:
        for k in sorted({k for _, k in (shapes or LINEAR_SHAPES).values()}):
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            nbytes = m * k * 3 + m * 4
            q, s = scaled_fp8_quant_per_token(x)
            eq, es = qref.fp8_quant_per_token(x)
            report(f"fp8 quant per-token M={m} K={k}", bench(lambda: scaled_fp8_quant_per_token(x)), nbytes=nbytes,
                   err=float((q.view(torch.uint8) != eq.view(torch.uint8)).sum() + (s != es).sum()), tol=0.0,
                   extra="(err: bytes and scales unlike the reference)")
            q, s = per_token_group_quant_fp8(x, 128)
            eq, es = qref.fp8_quant_per_token_group(x, 128)
            report(f"fp8 quant per-group 128 M={m} K={k}", bench(lambda: per_token_group_quant_fp8(x, 128)),
                   nbytes=nbytes, err=float((q.view(torch.uint8) != eq.view(torch.uint8)).sum() + (s != es).sum()),
                   tol=0.0)
            static = torch.tensor([0.01], device="cuda")
            report(f"fp8 quant static per-tensor M={m} K={k}", bench(lambda: scaled_fp8_quant_per_tensor(x, static)),
                   nbytes=m * k * 3)


def check_fused_quant(batches: tuple[int, ...] = (1, 16, 256, 4096)) -> None:
    """The activation quantization fused into its producer, as the fp8 model runs it before qkv / gate_up
    (fused_add_rms_norm_fp8) and before down (silu_and_mul_fp8), per token and per 1 x 128 group, beside the two
    launches each replaces. GB/s over the bytes read and written (x, residual in, residual, q and scales out;
    gate_up in, q and scales out); err counts q bytes and scales unlike the torch reference's."""
    from surge.kernels import quant_reference as qref
    from surge.kernels.activation import silu_and_mul, silu_and_mul_fp8
    from surge.kernels.fp8_quant import per_token_group_quant_fp8, scaled_fp8_quant_per_token
    from surge.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_fp8

    def mismatches(got, expected) -> float:
        return float((got[0].view(torch.uint8) != expected[0].view(torch.uint8)).sum() + (got[1] != expected[1]).sum())

    weight = torch.randn(HIDDEN, device="cuda", dtype=DTYPE)
    for m in batches:
        x, residual = torch.randn(2, m, HIDDEN, device="cuda", dtype=DTYPE)
        gate_up = torch.randn(m, 2 * INTERMEDIATE, device="cuda", dtype=DTYPE)
        for group, what in ((None, "per-token"), (128, "per-group 128")):
            def quant(y, group=group):
                return scaled_fp8_quant_per_token(y) if group is None else per_token_group_quant_fp8(y, group)

            def reference(y, group=group):
                return qref.fp8_quant_per_token(y) if group is None else qref.fp8_quant_per_token_group(y, group)

            scales = m * 4 * (1 if group is None else HIDDEN // group)
            q, scale, _ = fused_add_rms_norm_fp8(x, residual, weight, 1e-6, group)
            unfused = bench(lambda: quant(fused_add_rms_norm(x, residual, weight, 1e-6)[0]))
            report(f"fused_add_rms_norm_fp8 {what} T={m}",
                   bench(lambda: fused_add_rms_norm_fp8(x, residual, weight, 1e-6, group)),
                   nbytes=m * HIDDEN * (3 * 2 + 1) + scales, tol=0.0,
                   err=mismatches((q, scale), reference(fused_add_rms_norm(x, residual, weight, 1e-6)[0])),
                   extra=f"norm + quant {unfused * 1e6:.1f} us")
            scales = m * 4 * (1 if group is None else INTERMEDIATE // group)
            unfused = bench(lambda: quant(silu_and_mul(gate_up)))
            report(f"silu_and_mul_fp8 {what} T={m}", bench(lambda: silu_and_mul_fp8(gate_up, group)),
                   nbytes=m * INTERMEDIATE * (2 * 2 + 1) + scales, tol=0.0,
                   err=mismatches(silu_and_mul_fp8(gate_up, group), reference(silu_and_mul(gate_up))),
                   extra=f"silu_and_mul + quant {unfused * 1e6:.1f} us")


def check_moe_quant(batches: tuple[int, ...] = (1, 64, 2048), experts: int = 128, top_k: int = 8, hidden: int = 2048,
                    inter: int = 768) -> None:
    """Qwen3-30B-A3B's experts (128, top 8, hidden 2048, intermediate 768) as fp8 128x128 blocks and as MXFP4,
    beside bf16: the grouped GEMMs and combine on a prepared alignment; GB/s over the bytes of the experts reached;
    each checked against the torch reference on the dequantized weights (fp8: activations quantized alike)."""
    from surge.kernels import quant_reference as qref
    from surge.kernels.fused_moe import MoeQuant, fused_moe, grouped_experts, launch_policy
    from surge.kernels.moe_routing import align_to_blocks, route
    from surge.kernels.reference import fused_moe as torch_moe

    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=DTYPE) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=DTYPE) / inter ** 0.5
    fp8 = [_fp8_blocks(w.flatten(0, 1)) for w in (gate_up, down)]  # block rows never straddle experts here
    gate_up_q, down_q = fp8[0][0].view_as(gate_up), fp8[1][0].view_as(down)
    fp8_quant = MoeQuant("fp8_block", fp8[0][1].view(experts, -1, hidden // 128),
                         fp8[1][1].view(experts, -1, inter // 128))
    gate_up_deq = qref.dequantize_fp8(gate_up_q, fp8_quant.gate_up_scale, (128, 128))
    down_deq = qref.dequantize_fp8(down_q, fp8_quant.down_scale, (128, 128))
    blocks = [torch.randint(0, 256, (experts, r, c // 32, 16), device="cuda", dtype=torch.uint8)
              for r, c in ((2 * inter, hidden), (hidden, inter))]
    # Scales 2^-8 .. 2^-6: e2m1 codes have an rms of ~2.9, so the projections stay O(1) at these widths.
    e8m0 = [torch.randint(119, 122, b.shape[:3], device="cuda", dtype=torch.uint8) for b in blocks]
    mx_quant = MoeQuant("mxfp4", e8m0[0], e8m0[1])
    mx_deq = [qref.dequantize_mxfp4(b, s, torch.float32) for b, s in zip(blocks, e8m0)]

    def fake_quant(rows, _):
        return qref.fp8_fake_quant(rows.to(DTYPE), "group")

    def bf16_act(rows, which):
        return rows.to(DTYPE).float() if which == "down" else rows

    variants = {"bf16": (gate_up, down, None, 2.0, None),
                "fp8 block": (gate_up_q, down_q, fp8_quant, 1 + 2 / 128 ** 2, (gate_up_deq, down_deq, fake_quant)),
                "mxfp4": (blocks[0], blocks[1], mx_quant, 0.5 + 1 / 32, (mx_deq[0], mx_deq[1], bf16_act))}
    for tokens in batches:
        x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
        weights, ids = route(torch.randn(tokens, experts, device="cuda").to(DTYPE), top_k, True, DTYPE)
        launch = launch_policy(tokens, top_k, experts, hidden, inter)
        aligned = align_to_blocks(ids, experts, launch.block_m)
        reached = ids.unique().numel()
        flops = 2 * tokens * top_k * 3 * hidden * inter
        for name, (w1, w2, quant, bytes_per_weight, reference) in variants.items():
            nbytes = reached * 3 * hidden * inter * bytes_per_weight + tokens * hidden * 4
            err = None
            if reference is not None:
                got = fused_moe(x, w1, w2, weights, ids, quant=quant)
                expected = torch_moe(x.float(), reference[0], reference[1], weights.float(), ids,
                                     activation_quant=reference[2])
                err = max_err(got, expected)
            report(f"moe experts {name} T={tokens} ({reached} experts)",
                   bench(lambda: grouped_experts(x, w1, w2, weights, ids, *aligned, launch, quant=quant)),
                   nbytes=nbytes, flops=flops, err=err, tol=2e-2)


def check_gemv() -> None:
    """Decode linear layers of Qwen3-8B at M = 1, 2, 4: bf16 cuBLAS, fp8 per-token torch._scaled_mm (with its
    quantization), and the two fp8 decode GEMVs at their policies (the tiles kernel, SURGE_FP8_GEMV=tiles, and the
    stream kernel, the default), in us and GB/s of the weight; the 36 layers' total a step per kernel; then a sweep
    of stream launches at M = 1 (best three a layer)."""
    import itertools

    from surge.kernels.fp8_quant import scaled_fp8_quant_per_token
    from surge.kernels.gemv import StreamLaunch, fp8_gemv, launch_policy, stream_policy

    layers = (("qkv", HQ * HEAD_DIM + 2 * HKV * HEAD_DIM, HIDDEN), ("o", HIDDEN, HQ * HEAD_DIM),
              ("gate_up", 2 * INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("# decode GEMV (weight bytes / time): tiles = the earlier fp8 GEMV, stream = the default")
    totals: dict[tuple[str, int], float] = {}
    weights = {}
    for name, n, k in layers:
        w16 = torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02
        scale = (w16.abs().amax(1, keepdim=True).float() / 448).clamp_min(1e-12)
        w8 = (w16.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        weights[name] = (w8, scale)
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            expected = torch.nn.functional.linear(x.float(), w8.float() * scale)
            cases = {"bf16 cuBLAS": (lambda: torch.nn.functional.linear(x, w16), 2 * n * k)}

            def scaled_mm(x=x, w8=w8, scale=scale):
                q, s = scaled_fp8_quant_per_token(x)
                return torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=scale.view(1, -1), out_dtype=DTYPE)
            cases["fp8 _scaled_mm+quant"] = (scaled_mm, n * k)
            for kernel, launch in (("tiles", launch_policy(m, n, k)), ("stream", stream_policy(m, n, k, sms))):
                cases[f"fp8 {kernel}"] = (lambda launch=launch, x=x: fp8_gemv(x, w8, scale, launch=launch), n * k)
            for case, (fn, nbytes) in cases.items():
                seconds = bench(fn)
                totals[(case, m)] = totals.get((case, m), 0.0) + seconds
                err = max_err(fn(), expected) if case.startswith("fp8 ") and "scaled" not in case else None
                report(f"gemv {name} M={m} {case}", seconds, nbytes=nbytes, err=err, tol=2e-2)
    fp8_bytes = sum(n * k for _, n, k in layers)
    for (case, m), seconds in totals.items():
        nbytes = fp8_bytes * (2 if case.startswith("bf16") else 1)
        report(f"36 layers M={m} {case}", 36 * seconds, nbytes=36 * nbytes, extra="per step")
    print("# stream GEMV launch sweep, M=1 (best three a layer)")
    for name, n, k in layers:
        w8, scale = weights[name]
        x = torch.randn(1, k, device="cuda", dtype=DTYPE)
        sweep = [StreamLaunch(bn, chunks, stages, split) for bn, chunks, stages, split
                 in itertools.product((8, 16, 32), (16, 32, 64), (2, 3, 4, 5), (1, 2))]
        times = []
        for lc in sweep:
            try:
                times.append((bench(lambda lc=lc: fp8_gemv(x, w8, scale, launch=lc)), str(lc)))
            except Exception as e:  # a config the compiler refuses (shared memory): skipped, named
                print(f"  {lc}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        for seconds, lc in sorted(times)[:3]:
            report(f"gemv {name} stream {lc}", seconds, nbytes=n * k)


def check_wo_gemm(batches: tuple[int, ...] = (1, 8, 16, 32, 64, 128)) -> None:
    """Decode-sized linear layers of Qwen3-8B with fp8 weights: bf16 cuBLAS, torch._scaled_mm with its per-token
    quantization, the fp8 GEMV (M <= 4) and the weight-only tensor-core GEMM (fp8_wo_gemm) at its launch policy and
    the best of a sweep (GB/s of the weight bytes: the bound at these sizes)."""
    import itertools

    from surge.kernels.fp8_quant import scaled_fp8_quant_per_token
    from surge.kernels.fp8_wo_gemm import WoLaunch, fp8_wo_gemm, launch_policy
    from surge.kernels.gemv import MAX_ROWS, fp8_gemv

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("# fp8 weight-only GEMM at decode sizes (weight bytes / time)")
    for name, n, k in (("qkv", HQ * HEAD_DIM + 2 * HKV * HEAD_DIM, HIDDEN), ("o", HIDDEN, HQ * HEAD_DIM),
                       ("gate_up", 2 * INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE)):
        w16 = torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02
        scale = (w16.abs().amax(1, keepdim=True).float() / 448).clamp_min(1e-12)
        w8 = (w16.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        for m in batches:
            tag = f"{name} {n}x{k} M={m}"
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            expected = torch.nn.functional.linear(x.float(), w8.float() * scale)
            report(f"bf16 cuBLAS {tag}", bench(lambda: torch.nn.functional.linear(x, w16)), nbytes=2 * n * k)

            def scaled_mm():
                q, s = scaled_fp8_quant_per_token(x)
                return torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=scale.view(1, -1), out_dtype=DTYPE)
            report(f"fp8 _scaled_mm+quant {tag}", bench(scaled_mm), nbytes=n * k)
            if m <= MAX_ROWS:
                report(f"fp8 gemv {tag}", bench(lambda: fp8_gemv(x, w8, scale)), nbytes=n * k)
            policy = launch_policy(m, n, k, sms)
            report(f"fp8 wo_gemm {tag} {policy}", bench(lambda: fp8_wo_gemm(x, w8, scale)), nbytes=n * k,
                   err=max_err(fp8_wo_gemm(x, w8, scale), expected), tol=2e-2)
            sweep = [WoLaunch(policy.block_t, bn, 128, split) for bn, split in itertools.product((64, 128), (1, 4, 8))]
            best = min((bench(lambda lc=lc: fp8_wo_gemm(x, w8, scale, launch=lc)), str(lc)) for lc in sweep)
            report(f"fp8 wo_gemm best {tag} {best[1]}", best[0], nbytes=n * k)
            if m < 16:
                continue
            # W8A8 on the fp8 MMA, the activations quantized beforehand (by the norm / SiLU kernels in the model)
            xq, xs = scaled_fp8_quant_per_token(x)
            report(f"fp8 _scaled_mm alone {tag}", bench(lambda: torch._scaled_mm(
                xq, w8.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=DTYPE)), nbytes=n * k)
            sweep = [WoLaunch(policy.block_t, bn, bk, split, 4, stages) for bn, bk, split, stages
                     in itertools.product((64, 128), (128, 256), (1, 4), (3, 4))]
            expected = (xq.float() * xs) @ (w8.float() * scale).t()
            times = []
            for lc in sweep:
                try:
                    times.append((bench(lambda lc=lc: fp8_wo_gemm(xq, w8, scale, launch=lc, x_scale=xs,
                                                                  out_dtype=DTYPE)), str(lc), lc))
                except Exception as e:  # a config the compiler refuses (shared memory): skipped, named
                    print(f"  {lc}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            for seconds, name_lc, lc in sorted(times, key=lambda t: t[0])[:2]:
                got = fp8_wo_gemm(xq, w8, scale, x_scale=xs, out_dtype=DTYPE, launch=lc)
                report(f"fp8 w8a8 wo_gemm {tag} {name_lc}", seconds, nbytes=n * k, err=max_err(got, expected),
                       tol=2e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes")
    parser.add_argument("--only", choices=["layers", "attention", "mla", "sampling", "moe", "moe-sweep", "quant",
                                           "int4", "gemv", "wo", "lora"],
                        help="one group of kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("surge.bench.kernels needs a CUDA device (on the CPU: TRITON_INTERPRET=1 pytest tests/kernels)")
    torch.manual_seed(0)
    ceilings()
    if args.only in (None, "layers"):
        check_norm_rotary_activation()
    if args.only in (None, "attention"):
        check_attention(args.quick)
    if args.only in (None, "mla"):
        from surge.bench.kernels_mla import check_mla
        check_mla(args.quick, bench, report, max_err)
    if args.only in (None, "sampling"):
        check_sampling(args.quick)
    if args.only in (None, "moe"):
        from surge.bench.kernels_moe import check_moe_paths
        check_moe_paths(bench, report, max_err)
        check_moe()
    if args.only == "moe-sweep":
        from surge.bench.kernels_moe import check_moe_sweep
        check_moe_sweep(bench, report)
    if args.only in (None, "quant"):
        check_quant((1, 16, 4096) if args.quick else (1, 16, 256, 4096))
        check_fused_quant((1, 64, 4096) if args.quick else (1, 16, 64, 256, 4096))
        check_moe_quant()
    if args.only in (None, "int4"):
        from surge.bench.kernels_int4 import check_int4
        check_int4(args.quick, bench, report, max_err)
    if args.only in (None, "gemv"):
        check_gemv()
    if args.only in (None, "wo"):
        check_wo_gemm((1, 16, 64) if args.quick else (1, 8, 16, 32, 64, 128))
    if args.only in (None, "lora"):
        from surge.bench.kernels_lora import check_lora
        check_lora(bench, report, max_err, (1, 64, 2048) if args.quick else (1, 8, 64, 2048))
    if failures:
        sys.exit(f"FAILED: {', '.join(failures)}")
    print("# all checks passed")


if __name__ == "__main__":
    main()
