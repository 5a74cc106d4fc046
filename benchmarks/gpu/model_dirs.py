"""Write the model directories the GPU benchmarks load with ``load_format="dummy"``: a
config.json and the embedded SmolLM2 tokenizer, no weights (random bf16 weights are drawn on
the GPU at start).

- ``smollm2-135m``: the embedded model's own config (from its GGUF), as an HF config.json.
- ``llama3-8b``: Llama-3-8B's shapes (32 layers, hidden 4096, 32 query / 8 KV heads of 128,
  MLP 14336, vocab 128256, rope theta 500000, 8192 positions). Token ids from the SmolLM2
  tokenizer (< 49152) are valid inputs; sampled ids the tokenizer does not know decode to "".

Run here, where the GGUF is installed: ``python benchmarks/gpu/model_dirs.py .gpu/models``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def smollm2_config() -> dict:
    from chunkserve.model.loader import gguf_model_config, open_gguf, resolve_model

    cfg = gguf_model_config(open_gguf(resolve_model(None).path))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "torch_dtype": "bfloat16",
    }


def write_tokenizer(out: Path) -> None:
    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import open_gguf, resolve_model

    source = resolve_model(None)
    tok = Tokenizer.from_gguf(source.path, open_gguf(source.path))
    tok._tk.save(str(out / "tokenizer.json"))
    eos = tok._tk.id_to_token(tok.eos_token_ids[0]) if tok.eos_token_ids else None
    cfg = {"chat_template": tok.chat_template, "eos_token": eos}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    for name, cfg in (("smollm2-135m", smollm2_config()), ("llama3-8b", LLAMA3_8B)):
        d = args.out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        write_tokenizer(d)
        print(d)


if __name__ == "__main__":
    main()
