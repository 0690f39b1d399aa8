"""Build a tiny, randomly initialised model that vLLM can serve, with nothing downloaded.

    python examples/vllm/tiny_model.py DIR [--arch llama|gemma3] [--layers 4] [--seed 0]

``llama``: 4 layers, hidden 256, 8 attention heads, 4 KV heads (head size 32), bf16.
``gemma3``: the same sizes with Gemma 3's interleaved sliding-window layers (window 64,
every second layer full attention), so vLLM keeps two KV-cache groups.
The tokenizer is byte-level (256 byte tokens plus ``<s>`` and ``</s>``), built with
``tokenizers``; prompts given as token ids bypass it anyway. The same seed gives the same
weights, so two vLLM instances started from one directory compute the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 512  # 258 used by the tokenizer; the rest are valid ids for random prompts


def build_tokenizer(out: Path) -> None:
    """Write a byte-level tokenizer (no merges) that transformers and vLLM load offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<s>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(out)


def build_model(out: Path, arch: str, layers: int, seed: int) -> None:
    """Write the config and random bf16 weights of a tiny ``arch`` model to ``out``."""
    import torch

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
        bos_token_id=256, eos_token_id=257, tie_word_embeddings=False,
    )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=64, layer_types=types))
    else:
        raise SystemExit(f"--arch {arch!r}: use llama or gemma3")
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write (created)")
    ap.add_argument("--arch", default="llama", choices=("llama", "gemma3"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.layers < 1:
        print("tiny_model: --layers must be >= 1", file=sys.stderr)
        return 64
    args.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out)
    build_model(args.out, args.arch, args.layers, args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
