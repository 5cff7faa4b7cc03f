"""Stand-in written for eagleops' tests, not Moonshot's file: the remote-code tokenizer class
Kimi-K2.5's tokenizer_config.json names in ``auto_map`` (``TikTokenTokenizer``), so that it
loads only with ``trust_remote_code`` as the real one does. Like the real one it reads a
tiktoken rank file (``tiktoken.model``), splits text with Kimi's own pattern, whose first rule
keeps runs of Han characters apart from what precedes them (a generic byte-level pattern does
not: " 中文" splits differently), and numbers 256 special ids after the base ranks.
"""

import base64
import os
import shutil

import regex
from transformers import AddedToken, PreTrainedTokenizer

# Kimi's split pattern (tokenization_kimi.py's pat_str); `&&` is a set intersection (regex V1)
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
RESERVED_SPECIAL_TOKENS = 256


def _bytes_to_unicode():
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        self.ranks = {}
        with open(vocab_file, "rb") as f:
            for line in f:
                if line.strip():
                    token, rank = line.split()
                    self.ranks[base64.b64decode(token)] = int(rank)
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.encoder = {self._as_text(raw): rank for raw, rank in self.ranks.items()}
        base = len(self.ranks)
        named = {int(i): t for i, t in (added_tokens_decoder or {}).items()}
        decoder = {}
        for token_id in range(base, base + RESERVED_SPECIAL_TOKENS):
            token = named.get(token_id, AddedToken(f"<|reserved_token_{token_id}|>", special=True, normalized=False))
            decoder[token_id] = token if isinstance(token, AddedToken) else AddedToken(token, special=True)
            self.encoder[str(decoder[token_id])] = token_id
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.pattern = regex.compile(KIMI_PATTERN, flags=regex.V1)
        self._piece_cache = {}
        super().__init__(added_tokens_decoder=decoder, **kwargs)

    def _as_text(self, raw):
        return "".join(self.byte_encoder[b] for b in raw)

    @property
    def vocab_size(self):
        return len(self.ranks) + RESERVED_SPECIAL_TOKENS

    def get_vocab(self):
        return dict(self.encoder)

    def _bpe(self, piece):
        if piece in self.ranks:
            return [piece]
        parts = [bytes([b]) for b in piece]
        while len(parts) > 1:
            pairs = [(self.ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
            ranked = [(rank, i) for rank, i in pairs if rank is not None]
            if not ranked:
                break
            _, i = min(ranked)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def _tokenize(self, text, **kwargs):
        tokens = []
        for match in self.pattern.finditer(text):
            piece = match.group().encode("utf-8")
            if piece not in self._piece_cache:
                self._piece_cache[piece] = [self._as_text(p) for p in self._bpe(piece)]
            tokens.extend(self._piece_cache[piece])
        return tokens

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        text, pending = [], bytearray()
        for token in tokens:
            if token in self._added_tokens_encoder:
                text.append(pending.decode("utf-8", errors="replace") + token)
                pending = bytearray()
            else:
                pending.extend(self.byte_decoder[c] for c in token)
        text.append(pending.decode("utf-8", errors="replace"))
        return "".join(text)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
