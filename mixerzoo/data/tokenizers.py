"""Tokenizers of text corpora: load a tokenizer.json, train a byte-level BPE, find the end-of-text id, and the
id tokenizer of synthetic tasks (token ``i`` is the text ``"i"``). Step 4 of :mod:`mixerzoo.data.text`."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


from ..errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
# Special tokens tried, in order, as the document separator of a user-supplied tokenizer.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------
def load_tokenizer(path: str | os.PathLike, field: str = "data.tokenizer"):
    """Load a ``tokenizers.Tokenizer`` from a tokenizer.json (or a directory holding one).

    Raises:
        FileNotFoundError: the path does not exist. ConfigError: the file is not a tokenizer.json.
    """
    from tokenizers import Tokenizer

    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"{field}: {str(path)!r} does not exist (relative to {os.getcwd()}); give the path of a "
                                f"tokenizer.json, or null to train a BPE on the corpus")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON and for wrong content
        raise ConfigError(f"{field}: {str(p)!r} is not a valid tokenizer.json ({str(e).splitlines()[0][:200]}); "
                          f"give a file saved by `tokenizers`/`transformers` (e.g. the GPT-2 tokenizer.json), "
                          f"or null to train a BPE on the corpus") from e


def find_eos_id(tokenizer) -> int | None:
    """Id of the first of :data:`EOS_CANDIDATES` the tokenizer knows, or None."""
    for token in EOS_CANDIDATES:
        i = tokenizer.token_to_id(token)
        if i is not None:
            return i
    return None


def vocab_size_of(tokenizer) -> int:
    """Number of ids (including added/special tokens): one more than the largest id."""
    added = tokenizer.get_added_tokens_decoder()
    return max([tokenizer.get_vocab_size(with_added_tokens=True)] + [i + 1 for i in added])


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE (GPT-2 style: byte alphabet, GPT-2 pre-tokenisation regex, no prefix space)
    with ``<|endoftext|>`` as special token (id 0) on ``texts``. Returns a ``tokenizers.Tokenizer`` whose
    vocabulary is at most ``vocab_size`` (fewer if the text has fewer distinct merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def id_tokenizer(vocab_size: int):
    """A tokenizer for synthetic tasks whose tokens are numbers: token ``i`` is the text ``"i"``, split on
    whitespace (``"3 17 5"`` -> ``[3, 17, 5]``), decoded with single spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    return tok
