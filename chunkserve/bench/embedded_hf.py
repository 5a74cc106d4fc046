"""The embedded model as an HF transformers directory (config.json, model.safetensors in fp32,
tokenizer.json, tokenizer_config.json): the numerical reference of the tests and the
unquantized model of the quality benchmark. Built once with transformers (~30 s; needs
``accelerate``), per process under a temporary name: concurrent builders (parallel test
workers) each write their own and the first rename wins."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def embedded_hf_copy(out: Path) -> Path:
    """``out``, built from the embedded GGUF unless it already holds the weights."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import embedded_model_path, open_gguf

    gguf_path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok = Tokenizer.from_gguf(gguf_path, open_gguf(gguf_path))
    tok._tk.save(str(tmp / "tokenizer.json"))
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({**special, "chat_template": tok.chat_template})
    )
    try:
        tmp.rename(out)
    except OSError:  # another builder's copy landed first: the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
    return out
