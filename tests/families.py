"""Pretrained models of four families, as `--model <folder>` meets them: tiny (or any shape), built from a
config and saved with save_pretrained, with a tokenizer shaped like the family's (learnt from the texts
given); the decoders' tokenizers have no pad token, as those families ship them. For the tests
(conftest's `family_model`) and the benchmark's decoder job (benchmarks/decoder.py)."""

import json

FAMILIES = ("bert", "llama", "qwen2", "gpt2")
# Tiny and alike: hidden 32, 2 layers, 64 positions (--max_length 32 fits, 128 does not).
TINY_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=64)


def family_tokenizer(family: str, texts: list[str], folder):
    """A tokenizer shaped like `family`'s, learnt from `texts` (about 1,000 tokens) and saved in `folder`:
    BERT's WordPiece; Llama's SentencePiece-style BPE with byte fallback and <s> prepended; Qwen2's and
    GPT-2's byte-level BPE. Only BERT's has a pad token."""
    from tokenizers import ByteLevelBPETokenizer, Tokenizer, models, pre_tokenizers, trainers
    from transformers import BertTokenizerFast, GPT2TokenizerFast, LlamaTokenizerFast, Qwen2TokenizerFast

    from textclf.models.tokenizer import train_tokenizer

    if family == "bert":
        train_tokenizer(texts, str(folder))
        return BertTokenizerFast.from_pretrained(folder)
    if family == "llama":
        bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
        bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=special, limit_alphabet=300,
                                                           show_progress=False))
        learnt = json.loads(bpe.to_str())["model"]
        tokenizer = LlamaTokenizerFast(vocab=learnt["vocab"], merges=[tuple(m) for m in learnt["merges"]],
                                       add_bos_token=True)
    else:
        eos = "<|endoftext|>"
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(texts, vocab_size=1000, special_tokens=[eos], show_progress=False)
        learnt = json.loads(bpe._tokenizer.to_str())["model"]
        vocab, merges = learnt["vocab"], [tuple(m) for m in learnt["merges"]]
        tokenizer = (Qwen2TokenizerFast(vocab=vocab, merges=merges, eos_token=eos, unk_token=None, pad_token=None)
                     if family == "qwen2" else
                     GPT2TokenizerFast(vocab=vocab, merges=merges, bos_token=eos, eos_token=eos, unk_token=eos))
    tokenizer.save_pretrained(folder)
    return tokenizer


def family_config(family: str, tokenizer, **shape):
    """The config of a `family` model for `tokenizer`: TINY_SHAPE and the tokenizer's vocabulary, or `shape`
    (the same keys, vocab_size, and any other key of the family's config)."""
    from transformers import BertConfig, GPT2Config, LlamaConfig, Qwen2Config

    shape = {"vocab_size": len(tokenizer), **TINY_SHAPE, **shape}
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # no pad_token_id
    if family == "bert":
        return BertConfig(pad_token_id=tokenizer.pad_token_id, **shape)
    if family == "gpt2":
        return GPT2Config(vocab_size=shape["vocab_size"], n_embd=shape["hidden_size"],
                          n_layer=shape["num_hidden_layers"], n_head=shape["num_attention_heads"],
                          n_inner=shape["intermediate_size"],
                          n_positions=shape["max_position_embeddings"], **special)
    config_class = LlamaConfig if family == "llama" else Qwen2Config
    shape.setdefault("num_key_value_heads", 1)  # grouped-query attention, as both families use
    return config_class(**shape, **special)


def save_family_model(family: str, texts: list[str], folder, **shape):
    """A pretrained `family` model as a hub repo holds it: the language-model head (what Llama, Qwen2 and
    GPT-2 checkpoints ship; BERT's masked-LM head), the config, the tokenizer. Random weights, seed 0."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    tokenizer = family_tokenizer(family, texts, folder)
    config = family_config(family, tokenizer, **shape)
    torch.manual_seed(0)
    model_class = AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM
    model_class.from_config(config).save_pretrained(folder)
    return folder
