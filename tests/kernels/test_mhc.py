"""mHC: the torch references against HF's DeepseekV4HyperConnection (with the block's input RMSNorm) and the
decoder layer's stream mixing, the kernels against the references (fp32 and bf16, stream counts and widths off the
powers of two, one and many Sinkhorn iterations), and the launch policy at its boundaries."""
from __future__ import annotations

import pytest
import torch

from surge.kernels import deepseek_v4_reference as ref
from surge.kernels.mhc import MhcPre, launch_policy, mhc_post


def _hf_config(hc_mult: int, iters: int = 20):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=64, hidden_size=48, num_hidden_layers=1, num_attention_heads=2, head_dim=32,
                            q_lora_rank=16, index_n_heads=3, index_head_dim=16, index_topk=4, n_routed_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=16, o_groups=1, o_lora_rank=8,
                            hc_mult=hc_mult, hc_sinkhorn_iters=iters)


def _params(n: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = (2 + n) * n
    return (torch.randn(m, n * hidden, generator=g) * 0.05, torch.randn(m, generator=g), 1 + torch.rand(3, generator=g),
            1 + 0.1 * torch.randn(hidden, generator=g))


def test_references_match_hf():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4RMSNorm

    config = _hf_config(hc_mult=3, iters=5)
    hc = DeepseekV4HyperConnection(config)
    norm = DeepseekV4RMSNorm(48, eps=config.rms_norm_eps)
    fn, base, scale, weight = _params(3, 48, 0)
    with torch.no_grad():
        hc.fn.copy_(fn), hc.base.copy_(base), hc.scale.copy_(scale), norm.weight.copy_(weight)
        streams = torch.randn(2, 5, 3, 48)
        post, comb, collapsed = hc(streams)
        got = ref.mhc_pre(streams.flatten(0, 1), fn, base, scale, config.hc_eps, config.rms_norm_eps, 5, weight)
        torch.testing.assert_close(got[0], post.flatten(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(got[1], comb.flatten(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(got[2], norm(collapsed).flatten(0, 1), rtol=0, atol=0)
        block_out = torch.randn(2, 5, 48)
        mixed = post.unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        torch.testing.assert_close(ref.mhc_post(block_out.flatten(0, 1), streams.flatten(0, 1), got[0], got[1]),
                                   mixed.flatten(0, 1), rtol=0, atol=0)


def test_policy_boundaries():
    v4 = launch_policy(4, 4096)
    assert (v4.streams_pad, v4.block_k, v4.block_d) == (4, 512, 1024)
    assert launch_policy(5, 4096).streams_pad == 8 and launch_policy(5, 4096).block_k == 128
    assert launch_policy(4, 3).block_k == 16 and launch_policy(4, 3).block_d == 4  # the whole (padded) row
    assert launch_policy(4, 5).block_d == 8
    assert launch_policy(16, 4096).block_k == 32 and launch_policy(16, 4096).block_d == 256
    for bad in ((0, 8), (17, 8), (4, 0)):
        with pytest.raises(ValueError):
            launch_policy(*bad)


@pytest.mark.parametrize("n,hidden,iters,with_norm", [(4, 48, 20, True), (3, 40, 1, True), (2, 33, 3, False),
                                                      (1, 16, 2, True)])
def test_pre_fp32(n, hidden, iters, with_norm, device):
    fn, base, scale, weight = _params(n, hidden, n)
    streams = torch.randn(7, n, hidden, generator=torch.Generator().manual_seed(1))
    expected = ref.mhc_pre(streams, fn, base, scale, 1e-6, 1e-6, iters, weight if with_norm else None)
    got = MhcPre(device)(streams.to(device), fn.to(device), base.to(device), scale.to(device), 1e-6, 1e-6, iters,
                         weight.to(device) if with_norm else None)
    for g, e in zip(got, expected):  # the norm is applied after the projection: fp32 rounding apart
        torch.testing.assert_close(g.cpu(), e, rtol=1e-5, atol=1e-6)


def test_pre_bf16(device):
    fn, base, scale, weight = _params(4, 64, 5)
    streams = torch.randn(9, 4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = ref.mhc_pre(streams, fn, base, scale, 1e-6, 1e-6, 20, weight)
    post, comb, block_in = MhcPre(device)(streams.to(device), fn.to(device), base.to(device), scale.to(device), 1e-6,
                                          1e-6, 20, weight.to(device))
    torch.testing.assert_close(post.cpu(), expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.cpu(), expected[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block_in.cpu().float(), expected[2].float(), rtol=8e-3, atol=8e-3)  # one bf16 ulp
    assert (block_in.cpu() == expected[2]).float().mean() >= 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,hidden", [(4, 48), (3, 1030)])  # 1030: a second tile of channels
def test_post(n, hidden, dtype, device):
    g = torch.Generator().manual_seed(hidden)
    streams = torch.randn(5, n, hidden, generator=g).to(dtype)
    block_out = torch.randn(5, hidden, generator=g).to(dtype)
    post = 2 * torch.rand(5, n, generator=g)
    comb = torch.softmax(torch.randn(5, n, n, generator=g), dim=-1)
    expected = ref.mhc_post(block_out, streams, post, comb)
    got = mhc_post(block_out.to(device), streams.to(device), post.to(device), comb.to(device)).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=8e-3)
        assert (got == expected).float().mean() >= 0.95


def test_rejects_bad_arguments(device):
    fn, base, scale, weight = _params(2, 16, 0)
    pre = MhcPre(device)
    with pytest.raises(ValueError, match="fn must be"):
        pre(torch.zeros(1, 2, 16), fn[:, :16], base, scale, 1e-6, 1e-6, 2)
    with pytest.raises(ValueError, match="sinkhorn_iters=0"):
        pre(torch.zeros(1, 2, 16), fn, base, scale, 1e-6, 1e-6, 0)
    with pytest.raises(ValueError, match="norm_weight must be"):
        pre(torch.zeros(1, 2, 16), fn, base, scale, 1e-6, 1e-6, 2, weight[:8])
