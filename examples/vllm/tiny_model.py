"""Build a tiny, randomly initialised model that vLLM can serve, with nothing downloaded.

    python examples/vllm/tiny_model.py DIR [--arch llama|gemma3|nemotron_h|qwen3_next] [--layers 4]
        [--seed 0] [--dtype bfloat16|float32]

``llama``: 4 layers, hidden 256, 8 attention heads, 4 KV heads (head size 32), bf16.
``gemma3``: the same sizes with Gemma 3's interleaved sliding-window layers (window 64,
every second layer full attention), so vLLM keeps two KV-cache groups.
``nemotron_h``: Nemotron-H's hybrid of Mamba2 and attention, pattern ``M*M-`` (Mamba2,
attention, Mamba2, MLP; 8 Mamba heads of 32, 1 group, state 16, conv kernel 4).
``qwen3_next``: Qwen3-Next's hybrid of Gated DeltaNet and attention (3 ``linear_attention``
layers then one ``full_attention``; GDN 1 key head and 2 value heads of 128, 4 experts top-2).
vLLM's CPU GDN kernel runs bf16 only; the others also build as ``--dtype float32``.
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
ARCHS = ("llama", "gemma3", "nemotron_h", "qwen3_next")


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


def build_model(
    out: Path, arch: str, layers: int, seed: int, dtype: str = "bfloat16", groups: int = 1
) -> None:
    """Write the config and random weights (``dtype``) of a tiny ``arch`` model to ``out``
    (``groups``: Nemotron-H's Mamba2 groups, Qwen3-Next's Gated DeltaNet key heads)."""
    import torch

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=64, layer_types=types))
    elif arch == "nemotron_h":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        pattern = ("M*M-" * layers)[: max(layers, 2)]  # Mamba2, attention, Mamba2, MLP, ...
        model = NemotronHForCausalLM(
            NemotronHConfig(
                vocab_size=VOCAB,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=len(pattern),
                hybrid_override_pattern=pattern,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=32,
                mlp_hidden_act="relu2",
                mamba_num_heads=8,
                mamba_head_dim=32,
                n_groups=groups,
                ssm_state_size=16,
                conv_kernel=4,
                chunk_size=64,
                max_position_embeddings=4096,
                bos_token_id=256,
                eos_token_id=257,
                pad_token_id=0,
                tie_word_embeddings=False,
            )
        )
    elif arch == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        model = Qwen3NextForCausalLM(
            Qwen3NextConfig(
                vocab_size=VOCAB,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=layers,
                layer_types=types,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                linear_num_key_heads=groups,
                linear_num_value_heads=2 * groups,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_conv_kernel_dim=4,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=128,
                decoder_sparse_step=1,
                max_position_embeddings=4096,
                bos_token_id=256,
                eos_token_id=257,
                tie_word_embeddings=False,
            )
        )
    else:
        raise SystemExit(f"--arch {arch!r}: use one of {', '.join(ARCHS)}")
    torch_dtype = getattr(torch, dtype)
    model.to(torch_dtype).save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write (created)")
    ap.add_argument("--arch", default="llama", choices=ARCHS)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--mamba-groups",
        type=int,
        default=1,
        help="nemotron_h: Mamba2 groups (n_groups); qwen3_next: Gated DeltaNet key heads (twice as "
        "many value heads); a TP size vLLM runs the model at must divide it",
    )
    args = ap.parse_args(argv)
    if args.layers < 1:
        print("tiny_model: --layers must be >= 1", file=sys.stderr)
        return 64
    if args.mamba_groups < 1 or 8 % args.mamba_groups:
        print("tiny_model: --mamba-groups must be 1, 2, 4 or 8", file=sys.stderr)
        return 64
    args.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out)
    build_model(args.out, args.arch, args.layers, args.seed, args.dtype, args.mamba_groups)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
