"""A Hugging Face causal LM, quantized to NVFP4, compiled, generated from, saved and reloaded.

The model is a transformers LlamaForCausalLM built from a LlamaConfig in code (no download) with
seeded random weights. It is quantized with torchao's own `quantize_` and a qtensor config
(NVFP4 weights with 4over6, NVFP4 row-scaled activations), then:
  1. run eagerly and compared with the bf16 model (SQNR of the logits);
  2. run under torch.compile (fullgraph) and compared with eager, bit for bit;
  3. asked for a few greedy tokens;
  4. saved as a state_dict, loaded with torch.load(weights_only=True) into a freshly built and
     quantized model, and compared with the original, bit for bit (logits and tokens).

    python examples/hf_causal_lm.py            # hidden 512, 4 layers, inductor
    python examples/hf_causal_lm.py --tiny --compile-backend aot_eager   # what CI runs

Needs `pip install transformers` (or `pip install 'qtensor[hf]'`). On a CPU every product runs
on qtensor's exact emulated GEMM. Inductor's first compile of this model is slow on a small CPU
(2026-11-30, 2 shared cores: 69 s at --tiny, 217 s at the default size), so CI traces with the
aot_eager backend (dynamo + AOTAutograd, fullgraph, ~15 s) instead; both give logits bitwise
equal to eager.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import transformers
from torchao.quantization import quantize_

from qtensor import NVFP4DynamicActivationNVFP4WeightConfig, NVFP4Spec
from qtensor.cli.analyze import sqnr_db

CONFIG = NVFP4DynamicActivationNVFP4WeightConfig(
    weight=NVFP4Spec(fourover6="mae", e4m3_bound=256),
    activation=NVFP4Spec(row_scaled=True),
)


def llama_config(tiny: bool) -> transformers.LlamaConfig:
    # Every Linear's in_features is a multiple of 32, so NVFP4 (16) and MXFP8 (32) both apply.
    hidden, layers, inter, vocab = (128, 2, 352, 512) if tiny else (512, 4, 1408, 8192)
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
        max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
    )


def build_model(config: transformers.LlamaConfig, seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def generate(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens)


def compiled_logits(model, ids: torch.Tensor, backend: str) -> tuple[torch.Tensor, float]:
    # Inductor by default keeps fused bf16 intermediates in fp32 (no rounding between ops);
    # NVFP4's 4-bit activation grid turns those last-bit differences into whole code steps
    # (about 15 dB off eager on this model). Emulating the casts makes compiled == eager.
    inductor_config.emulate_precision_casts = True
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    start = time.perf_counter()
    out = logits(compiled, ids)
    return out, time.perf_counter() - start


def save_and_reload(model, config, path: Path) -> transformers.LlamaForCausalLM:
    """torch.save the state_dict, then load it into a new model quantized the same way."""
    torch.save(model.state_dict(), path)
    fresh = build_model(config, seed=1)  # other weights: everything must come from the file
    quantize_(fresh, CONFIG)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    return fresh


def check(ok: bool, what: str) -> None:
    print(f"{what}: {'yes' if ok else 'NO'}")
    if not ok:
        sys.exit(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="hidden 128, 2 layers (CI size)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args(argv)

    config = llama_config(args.tiny)
    model = build_model(config, seed=0)
    bf16 = copy.deepcopy(model)
    quantize_(model, CONFIG)  # torchao's entry point takes qtensor's configs
    print(f"{type(model).__name__}, hidden {config.hidden_size}, {config.num_hidden_layers} "
          f"layers; o_proj weight: {model.model.layers[0].self_attn.o_proj.weight!r}")

    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    eager = logits(model, ids)
    print(f"logits SQNR vs bf16: {sqnr_db(logits(bf16, ids).float(), eager.float()):.2f} dB")

    compiled, seconds = compiled_logits(model, ids, args.compile_backend)
    print(f"torch.compile(backend={args.compile_backend!r}, fullgraph=True): {seconds:.1f} s")
    check(torch.equal(compiled, eager), "compiled logits == eager logits, bit for bit")

    tokens = generate(model, ids[:, :8], args.new_tokens)
    print(f"greedy tokens: {tokens[:, 8:].tolist()}")

    with tempfile.TemporaryDirectory() as tmp:
        reloaded = save_and_reload(model, config, Path(tmp) / "model.pt")
    check(torch.equal(logits(reloaded, ids), eager), "reloaded logits == saved, bit for bit")
    check(torch.equal(generate(reloaded, ids[:, :8], args.new_tokens), tokens),
          "reloaded greedy tokens == saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
