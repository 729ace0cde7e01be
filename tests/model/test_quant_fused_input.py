"""Activation quantization fused into the layer before an fp8 GEMM (surge/model/quant/quantized_input.py): where it
is wired, that the GEMMs then really take pre-quantized inputs, and that the fused producers compute exactly what the
unfused path does (the GEMM quantizing its own input), on the CPU's torch path here and on CUDA's kernels where a GPU
is present. The fused Triton kernels themselves are checked against the torch reference in
tests/kernels/test_fp8_quant.py; the models against HF in tests/model/test_quant.py."""
from __future__ import annotations

import pytest
import torch

from surge import LLM, SamplingParams
from surge.model.quant.quantized_input import QuantizedInput
from tiny_models import make_tiny_model, tiny_config
from tiny_quant import save_compressed_tensors, save_hf_fp8_block


def _llm(kind: str, tmp_path) -> LLM:
    quantization = None
    if kind == "online-fp8":
        path = make_tiny_model("llama", tmp_path)
        quantization = "fp8"
    elif kind == "hf-fp8-block":
        save_hf_fp8_block(tiny_config("llama"), tmp_path, block=(32, 32))
        path = tmp_path
    elif kind == "fp8-static":
        save_compressed_tensors(tiny_config("llama"), tmp_path, "FP8")
        path = tmp_path
    else:
        path = make_tiny_model("llama", tmp_path)
    return LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_model_len=64,
               quantization=quantization)


@pytest.mark.parametrize("kind, group", [("online-fp8", None), ("hf-fp8-block", 32), ("fp8-static", "none"),
                                         ("unquantized", "none")])
def test_producers_quantize_for_the_fp8_layer_that_alone_reads_them(kind, group, tmp_path):
    """Dynamic fp8 activations (per token; per 1 x 32 group for 32 x 32 blocks): both norms and SiLU-and-mul hold
    their consumer, and a generation feeds qkv, gate_up and down pre-quantized inputs (o_proj's comes from
    attention, quantized by the GEMM itself). Static scales and unquantized models: nothing wired."""
    llm = _llm(kind, tmp_path)
    model = llm.engine.executor.runner.model
    inputs: dict[str, set[type]] = {}
    for layer in model.layers:
        pairs = [(layer.input_layernorm, layer.self_attn.qkv_proj),
                 (layer.post_attention_layernorm, layer.mlp.gate_up_proj), (layer.mlp.act, layer.mlp.down_proj)]
        for producer, consumer in pairs:
            if group == "none":
                assert producer.output_quant is None
            else:
                assert producer.output_quant.consumer is consumer and producer.output_quant.group_size == group
        for name in ("qkv_proj", "o_proj"):
            getattr(layer.self_attn, name).register_forward_pre_hook(
                lambda m, args, name=name: inputs.setdefault(name, set()).add(type(args[0])))
        for name in ("gate_up_proj", "down_proj"):
            getattr(layer.mlp, name).register_forward_pre_hook(
                lambda m, args, name=name: inputs.setdefault(name, set()).add(type(args[0])))
    llm.generate([[5, 6, 7, 8, 9, 10], [11, 12]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    fused = {QuantizedInput} if group != "none" else {torch.Tensor}
    assert inputs == {"qkv_proj": fused, "gate_up_proj": fused, "down_proj": fused, "o_proj": {torch.Tensor}}


def _unfused(producer, *args):
    quant, producer.output_quant = producer.output_quant, None
    try:
        return producer(*args)
    finally:
        producer.output_quant = quant


def _check_layer_fused_equals_unfused(layer, x: torch.Tensor, residual: torch.Tensor, exact: bool) -> None:
    """norm (+ residual) -> qkv, and norm -> gate_up -> SiLU-and-mul -> down, fused against unfused."""
    def close(got, expected):
        torch.testing.assert_close(got, expected, atol=0, rtol=0) if exact else \
            torch.testing.assert_close(got, expected)

    attn, mlp = layer.self_attn, layer.mlp
    for norm, first in ((layer.input_layernorm, attn.qkv_proj), (layer.post_attention_layernorm, mlp.gate_up_proj)):
        fused, fused_residual = norm(x, residual)
        plain, plain_residual = _unfused(norm, x, residual)
        assert type(fused) is (QuantizedInput if norm.output_quant.wanted(x) else torch.Tensor)
        close(fused_residual, plain_residual)
        close(first(fused), first(plain))
        close(first(norm(x)), first(_unfused(norm, x)))  # the first layer's norm: no residual
    gate_up = mlp.gate_up_proj(x)
    close(mlp.down_proj(mlp.act(gate_up)), mlp.down_proj(_unfused(mlp.act, gate_up)))


@pytest.mark.parametrize("kind", ["online-fp8", "hf-fp8-block"])
def test_fused_producers_compute_the_unfused_math_on_cpu(kind, tmp_path):
    """On the CPU the producer quantizes with the torch reference and the GEMM dequantizes: bitwise what the GEMM's
    own simulated quantization computes, at any row count (the CPU has no GEMV path)."""
    model = _llm(kind, tmp_path).engine.executor.runner.model
    hidden = model.layers[0].input_layernorm.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5):
        x, residual = torch.randn(2, rows, hidden, generator=g)
        assert model.layers[0].input_layernorm.output_quant.wanted(x)
        _check_layer_fused_equals_unfused(model.layers[1], x, residual, exact=True)


def test_a_lora_adapter_keeps_its_layer_input_unquantized(tmp_path):
    """The adapter reads the layer's input: with one attached, the producer hands on the tensor."""
    model = _llm("online-fp8", tmp_path).engine.executor.runner.model
    layer = model.layers[0]
    x = torch.randn(3, layer.input_layernorm.weight.shape[0])
    assert type(layer.input_layernorm(x)) is QuantizedInput
    layer.self_attn.qkv_proj.lora = object()  # any adapter: only its presence is asked
    try:
        assert type(layer.input_layernorm(x)) is torch.Tensor
    finally:
        layer.self_attn.qkv_proj.lora = None


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights, activations, block", [("channel", "token", None), ("block", "group", (128, 128))])
def test_a_decoder_layer_fused_computes_what_it_does_unfused(weights, activations, block, device):
    """A DecoderLayer's norms and MLP wired by fuse_input_quant, against the same layer unwired. CUDA, bf16: the
    fused Triton quantization equals the separate kernels' bit for bit, so the torch._scaled_mm outputs are
    identical; up to the weight-only kernels' rows (WEIGHT_ONLY_KERNELS: the GEMV and the weight-only GEMM read bf16) and for group scales at row counts not a multiple of 4
    nothing is fused. CPU, float32: the torch reference, fused at every row count."""
    from surge.model.layers.linear import Linear, QKVParallelLinear
    from surge.model.models.llama import MLP, DecoderAttention, DecoderLayer
    from surge.model.quant.fp8 import GEMV_ROWS, WEIGHT_ONLY_KERNELS, Fp8LinearMethod

    weight_only_rows = WEIGHT_ONLY_KERNELS[-1][0]

    class Attention(torch.nn.Module):  # DecoderAttention's qkv projection, without the attention kernel
        input_linear = DecoderAttention.input_linear

        def __init__(self):
            super().__init__()
            self.qkv_proj = QKVParallelLinear(512, 64, 8, 2)

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    method = Fp8LinearMethod(weights, activations, block)
    with torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            layer = DecoderLayer(512, 1e-6, Attention(), MLP(512, 768))
        finally:
            torch.set_default_dtype(torch.float32)
        for i, linear in enumerate(m for m in layer.modules() if isinstance(m, Linear)):
            del linear.weight
            linear.set_method(method, torch.device(device))
            method.init_dummy(linear, torch.Generator(device=device).manual_seed(i))
        layer.input_layernorm.weight.normal_()
        layer.post_attention_layernorm.weight.normal_()
    layer.fuse_input_quant()
    layer.mlp.fuse_input_quant()
    # x holds 2 x rows rows: the boundaries of the weight-only kernels, both sides.
    for rows in (1, GEMV_ROWS // 2, GEMV_ROWS // 2 + 1, weight_only_rows // 2, weight_only_rows // 2 + 1, 64, 301):
        x, residual = torch.randn(2, rows, 512, device=device, dtype=dtype)
        wanted = device == "cpu" or 2 * rows > weight_only_rows and not (activations == "group" and 2 * rows % 4)
        assert layer.input_layernorm.output_quant.wanted(x) == wanted
        _check_layer_fused_equals_unfused(layer, x, residual, exact=True)
