"""Multi-query associative recall (MQAR), the synthetic recall task of Zoology (Arora et al. 2023,
"Zoology: Measuring and Improving Recall in Efficient Language Models", section 3).

A sequence first lists key-value pairs, then asks for the values of some of the keys. Models whose state
cannot hold every pair (fixed-size recurrent states, sliding windows shorter than the gap) fail it, which is
why it is the default probe of a sequence mixer's recall. Generated in process with a seeded
``torch.Generator``; no download.

Layout of one example (``make_mqar``), with ``K = num_kv_pairs``, ``Q = num_queries``, ``V = vocab_size``,
``T = seq_len``::

    positions 0 .. 2K-1   k_1 v_1 k_2 v_2 ... k_K v_K          (kv section)
    positions 2K .. T-1   0 0 k_a v_a 0 k_b v_b 0 0 ...          (query section: Q pairs, filler 0 elsewhere)
    labels                -100 everywhere except at each queried key k_a, where the label is v_a

Keys come from ``1 .. V//2 - 1`` and values from ``V//2 .. V-1`` (disjoint halves; id 0 is the filler), keys
are distinct within an example (values too, as in Zoology), the ``Q`` queried keys are distinct pairs of the
kv section in random order, at positions drawn uniformly among all non-overlapping placements. Each queried
key is followed by its value, so with teacher forcing the input at ``t + 1`` equals the label at ``t``.
Differences from Zoology's MQAR: Zoology places query keys at power-law distributed gaps, leaves the token after
a query key as filler (random noise by default), and queries every key; here positions are uniform, the value
follows its key, and ``num_queries`` may be below ``K``. ``format: zoology`` (:func:`make_mqar_zoology`) generates
Zoology's version, for numbers comparable with its paper.
"""

from __future__ import annotations

import torch

from ..model.config import ConfigError
from .base import IGNORE_INDEX, LMDataModule, TensorPairDataset, check_int

__all__ = ["RecallDataModule", "make_mqar", "make_mqar_zoology", "make_mqar_in_format", "mqar_max_kv_pairs", "power_law_gap_probs",
           "MQAR_FORMATS", "kv_pair_counts"]

MQAR_FORMATS = ("mixerzoo", "zoology")

FILLER = 0


def mqar_max_kv_pairs(vocab_size: int, seq_len: int, num_queries: int | None = None) -> int:
    """Largest ``num_kv_pairs`` that fits: distinct keys need ``K <= vocab_size // 2 - 1`` and the kv section
    (``2K`` tokens) plus the query pairs (``2Q`` tokens, ``Q = K`` when ``num_queries`` is None) must fit in
    ``seq_len``."""
    by_vocab = vocab_size // 2 - 1
    by_len = seq_len // 4 if num_queries is None else (seq_len - 2 * num_queries) // 2
    return max(0, min(by_vocab, by_len))


def _check_mqar(vocab_size: int, seq_len: int, num_kv_pairs: int, num_queries: int | None, prefix: str = "data.") -> int:
    """Validate MQAR sizes; return the effective ``num_queries``. Raises ConfigError naming the field."""
    check_int(f"{prefix}vocab_size", vocab_size, 4, "MQAR needs keys and values from two halves of the vocabulary")
    check_int(f"{prefix}seq_len", seq_len, 2, "a row needs at least two tokens")
    check_int(f"{prefix}num_kv_pairs", num_kv_pairs, 1)
    if num_queries is not None:
        check_int(f"{prefix}num_queries", num_queries, 1, "or null for num_queries = num_kv_pairs")
        if num_queries > num_kv_pairs:
            raise ConfigError(f"{prefix}num_queries={num_queries} exceeds {prefix}num_kv_pairs={num_kv_pairs}: "
                              f"queried keys are distinct pairs of the kv section; lower num_queries")
    queries = num_kv_pairs if num_queries is None else num_queries
    limit = mqar_max_kv_pairs(vocab_size, seq_len, num_queries)
    if num_kv_pairs > limit:
        why = []
        if num_kv_pairs > vocab_size // 2 - 1:
            why.append(f"distinct keys come from ids 1..{vocab_size // 2 - 1}")
        if 2 * num_kv_pairs + 2 * queries > seq_len:
            why.append(f"{num_kv_pairs} pairs (2 tokens each) plus {queries} queries (key + value) need "
                       f"{2 * num_kv_pairs + 2 * queries} > seq_len={seq_len} tokens")
        raise ConfigError(f"{prefix}num_kv_pairs={num_kv_pairs} is too many for seq_len={seq_len} and "
                          f"vocab_size={vocab_size}: at most {limit} ({'; '.join(why)}); lower num_kv_pairs or "
                          f"raise seq_len/vocab_size")
    return queries


def kv_pair_counts(num_kv_pairs: int | list[int], field: str = "data.num_kv_pairs") -> list[int]:
    """``num_kv_pairs`` as a non-empty list of distinct positive counts (one int gives a one-element list).

    Raises:
        ConfigError: an empty list, a repeated count or a count below 1; the message names ``field``.
    """
    counts = list(num_kv_pairs) if isinstance(num_kv_pairs, (list, tuple)) else [num_kv_pairs]
    if not counts:
        raise ConfigError(f"{field} is an empty list; give a count (e.g. 16) or a list of counts (e.g. [4, 8, 16])")
    for k in counts:
        check_int(field, k, 1)
    if len(set(counts)) != len(counts):
        raise ConfigError(f"{field}={counts} repeats a count; list each kv-pair count once")
    return counts


def _sample_distinct(n: int, population: int, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``(n, k)`` int64: in each row, ``k`` distinct values of ``range(population)`` in uniformly random order.

    Small populations (``<= 8k``): the indices of the top-``k`` of ``population`` i.i.d. uniforms (a uniform
    random ``k``-permutation), in row chunks of ~4M floats. Large ones: Robert Floyd's algorithm, vectorised
    over rows (a uniform ``k``-subset in ``O(k^2)`` per row, independent of ``population``), then shuffled.
    """
    if population < k:
        raise ValueError(f"cannot draw {k} distinct values from {population}")
    if population <= 8 * k:
        out = torch.empty(n, k, dtype=torch.long)
        chunk = max(1, (1 << 22) // max(population, 1))
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            scores = torch.rand(stop - start, population, generator=generator)
            out[start:stop] = scores.topk(k, dim=1).indices
        return out
    # Floyd: for j = P-k .. P-1 draw t uniform in [0, j]; take t unless already taken, then take j (never
    # taken before, as every earlier pick is < j).
    sel = torch.empty(n, k, dtype=torch.long)
    for i, j in enumerate(range(population - k, population)):
        t = torch.randint(0, j + 1, (n,), generator=generator)
        taken = (sel[:, :i] == t[:, None]).any(dim=1)
        sel[:, i] = torch.where(taken, torch.full_like(t, j), t)
    order = torch.rand(n, k, generator=generator).argsort(dim=1)
    return sel.gather(1, order)


def make_mqar(
    n: int,
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    num_queries: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate ``n`` MQAR examples (vectorised; 20k x 128 tokens take well under a second).

    Layout of each row (``K = num_kv_pairs``, ``Q = num_queries`` or ``K``, ``V = vocab_size``, ``T = seq_len``):

    - ``input_ids[:, 0:2K]`` is the kv section ``k_1 v_1 ... k_K v_K``: keys distinct, drawn uniformly from
      ``[1, V//2)``; values distinct, drawn uniformly from ``[V//2, V)`` (key and value ids never overlap).
    - ``input_ids[:, 2K:T]`` is the query section: ``Q`` distinct kv pairs (chosen uniformly, in random order),
      each written as its key at some position ``p`` followed by its value at ``p + 1``; the positions are
      uniform over all placements where the pairs do not overlap; every other position holds the filler 0.
    - ``labels`` is -100 everywhere except ``labels[:, p] = value`` at each queried key position ``p``: the
      loss is only on answers. Labels are already shifted (``labels[:, t]`` is the target for position ``t``).

    Args:
        n: number of examples. vocab_size: ``V`` (>= 4). seq_len: ``T``. num_kv_pairs: ``K``.
        num_queries: ``Q <= K`` (None: ``K``, every key is queried once, as in Zoology's MQAR).
        generator: a seeded ``torch.Generator`` (None: torch's global generator).

    Returns:
        ``(input_ids, labels)``, both ``(n, seq_len)`` int64.

    Raises:
        ConfigError (a ``ValueError``): sizes that do not fit; the message names the field and the largest
            ``num_kv_pairs`` that fits.
    """
    check_int("n", n, 0)
    q = _check_mqar(vocab_size, seq_len, num_kv_pairs, num_queries, prefix="")
    k = num_kv_pairs
    half = vocab_size // 2
    keys = 1 + _sample_distinct(n, half - 1, k, generator)  # (n, K) in [1, V//2)
    values = half + _sample_distinct(n, vocab_size - half, k, generator)  # (n, K) in [V//2, V)

    input_ids = torch.full((n, seq_len), FILLER, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    input_ids[:, 0 : 2 * k : 2] = keys
    input_ids[:, 1 : 2 * k : 2] = values

    # Which pairs are queried, in which order.
    which = _sample_distinct(n, k, q, generator)  # (n, Q)
    q_keys, q_values = keys.gather(1, which), values.gather(1, which)
    # Where: Q non-overlapping 2-token slots in a region of R = T - 2K positions. With s_0 < ... < s_{Q-1}
    # distinct sorted draws from range(R - Q), p_i = s_i + i gives p_{i+1} >= p_i + 2 and p_{Q-1} <= R - 2,
    # a bijection onto the valid placements, hence uniform over them.
    region = seq_len - 2 * k
    s = _sample_distinct(n, region - q, q, generator).sort(dim=1).values
    pos = 2 * k + s + torch.arange(q)
    input_ids.scatter_(1, pos, q_keys)
    input_ids.scatter_(1, pos + 1, q_values)
    labels.scatter_(1, pos, q_values)
    return input_ids, labels


def power_law_gap_probs(slots: int, power_a: float) -> torch.Tensor:
    """Probability of each query slot ``i = 1 .. slots`` in Zoology's MQAR: ``p_i ∝ a * i^(a - 1)`` (a power law
    with exponent ``a - 1``; ``a = 0.01`` puts most queries right after the kv section, so short gaps dominate and
    a few queries sit far away). Returns ``(slots,)`` float64 summing to 1."""
    i = torch.arange(1, slots + 1, dtype=torch.float64)
    p = power_a * i ** (power_a - 1)
    return p / p.sum()


def make_mqar_zoology(
    n: int,
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    num_passes: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR as the Zoology paper specifies it (Arora et al. 2023, section 3 and appendix; its ``multiquery_ar``
    parameters), written from that description.

    Layout of each row (``K = num_kv_pairs``, ``P = num_passes``, ``V = vocab_size``, ``T = seq_len``):

    - the kv section ``k_1 v_1 ... k_K v_K``, written ``P`` times (``P > 1`` is the JRT variant: the context
      repeated before the questions); keys distinct from ``[1, V//2)``, values distinct from ``[V//2, V)``;
    - the query region, ``T - 2KP`` positions cut into ``(T - 2KP) // 2`` two-token slots; every key is queried
      once, at the first position of a slot drawn without replacement with probability
      :func:`power_law_gap_probs` (``power_a``), keys assigned to slots in random order;
    - the value is **not** written after its queried key: the position after it is filler, like every position
      that is not a query key. Filler is 0, or with ``random_non_queries`` a uniformly random token of
      ``[0, V)`` (noise the model must ignore; Zoology's default).
    - ``labels`` is -100 except at each query key, where it is that key's value (already shifted: the target
      of position ``t``).

    Args:
        n: examples. vocab_size, seq_len, num_kv_pairs: ``V``, ``T``, ``K``. power_a: the power law's ``a`` (> 0).
        random_non_queries: random filler instead of 0. num_passes: repetitions of the kv section (>= 1).
        generator: a seeded ``torch.Generator``.

    Returns:
        ``(input_ids, labels)``, both ``(n, seq_len)`` int64.

    Raises:
        ConfigError: sizes that do not fit (keys need ``K <= V//2 - 1``; the kv sections plus ``K`` query slots
            need ``2KP + 2K <= T``), ``power_a <= 0`` or ``num_passes < 1``; the message names the field.
    """
    check_int("n", n, 0)
    check_int("vocab_size", vocab_size, 4, "MQAR needs keys and values from two halves of the vocabulary")
    check_int("num_kv_pairs", num_kv_pairs, 1)
    check_int("num_passes", num_passes, 1, "1 is plain MQAR, more repeats the kv section (JRT)")
    if not power_a > 0:
        raise ConfigError(f"power_a={power_a!r} must be > 0 (Zoology uses 0.01)")
    k, half = num_kv_pairs, vocab_size // 2
    if k > half - 1:
        raise ConfigError(f"num_kv_pairs={k} is too many for vocab_size={vocab_size}: distinct keys come from ids "
                          f"1..{half - 1}; lower num_kv_pairs or raise vocab_size")
    slots = (seq_len - 2 * k * num_passes) // 2
    if slots < k:
        raise ConfigError(f"num_kv_pairs={k} is too many for seq_len={seq_len} with num_passes={num_passes}: the kv "
                          f"section{'s' if num_passes > 1 else ''} ({2 * k * num_passes} tokens) leave {max(slots, 0)} "
                          f"query slots of 2 tokens for {k} queries; lower num_kv_pairs or raise seq_len")
    keys = 1 + _sample_distinct(n, half - 1, k, generator)
    values = half + _sample_distinct(n, vocab_size - half, k, generator)
    if random_non_queries:
        input_ids = torch.randint(0, vocab_size, (n, seq_len), generator=generator)
    else:
        input_ids = torch.full((n, seq_len), FILLER, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    kv = torch.stack([keys, values], dim=2).reshape(n, 2 * k)
    for p in range(num_passes):
        input_ids[:, 2 * k * p: 2 * k * (p + 1)] = kv
    probs = power_law_gap_probs(slots, power_a).float().expand(n, slots)
    slot = torch.multinomial(probs, k, replacement=False, generator=generator)  # (n, K), key j -> slot[:, j]
    pos = 2 * k * num_passes + 2 * slot
    input_ids.scatter_(1, pos, keys)
    labels.scatter_(1, pos, values)
    return input_ids, labels


def make_mqar_in_format(n: int, vocab_size: int, seq_len: int, num_kv_pairs: int, format: str = "mixerzoo",
                        num_queries: int | None = None, power_a: float = 0.01, random_non_queries: bool = True,
                        num_passes: int = 1, generator: torch.Generator | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR examples in ``format``: ``mixerzoo`` (:func:`make_mqar`, takes ``num_queries``) or ``zoology``
    (:func:`make_mqar_zoology`, takes ``power_a``, ``random_non_queries``, ``num_passes``). The one place that
    picks the generator, for training data and evaluation sweeps alike.

    Raises:
        ConfigError: an unknown format, or sizes that do not fit (see the generators).
    """
    if format == "zoology":
        return make_mqar_zoology(n, vocab_size, seq_len, num_kv_pairs, power_a, random_non_queries, num_passes,
                                 generator)
    if format == "mixerzoo":
        return make_mqar(n, vocab_size, seq_len, num_kv_pairs, num_queries, generator)
    raise ConfigError(f"format={format!r} is not an MQAR format; use one of {list(MQAR_FORMATS)}")


class RecallDataModule(LMDataModule):
    """Multi-query associative recall (MQAR, Zoology section 3) as a Lightning data module.

    Train and val sets are generated in ``setup`` from two different seeds derived from ``seed``
    (``2 * seed`` and ``2 * seed + 1``), so they are reproducible and (almost surely) disjoint. See
    :func:`make_mqar` for the exact layout. ``vocab_size`` is known right after construction;
    ``tokenizer`` and ``eos_id`` are None.

    Raises:
        ConfigError (a ``ValueError``): at construction, for sizes that do not fit (the message gives the
            largest ``num_kv_pairs`` for this ``seq_len``/``vocab_size``) or non-positive counts.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 128,
        num_kv_pairs: int | list[int] = 16,
        num_queries: int | None = None,
        train_examples: int = 20000,
        val_examples: int = 1000,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
        format: str = "mixerzoo",
        power_a: float = 0.01,
        random_non_queries: bool = True,
        num_passes: int = 1,
    ) -> None:
        """
        Args:
            vocab_size: token vocabulary; keys use ids ``1 .. vocab_size//2 - 1``, values the upper half, 0 is
                the filler.
            seq_len: tokens per example (kv section + query section).
            num_kv_pairs: key-value pairs per example (at most ``min(vocab_size//2 - 1, seq_len//4)`` with the
                default ``num_queries``), or a list of counts: a mixture, the examples split evenly among them
                (remainder to the first) and shuffled, as Zoology trains one model on several kv-pair counts.
            num_queries: queried pairs per example, at most ``num_kv_pairs``; null means ``num_kv_pairs``.
            train_examples: number of training examples.
            val_examples: number of validation examples (also used for test and predict).
            batch_size: examples per batch.
            seed: seed of the generators (train uses ``2*seed``, val ``2*seed + 1``) and of the train shuffle.
            num_workers: DataLoader worker processes.
            format: ``mixerzoo`` (:func:`make_mqar`: uniform query positions, the value echoed after its key) or
                ``zoology`` (:func:`make_mqar_zoology`: exactly the Zoology paper's MQAR, comparable with its
                figures and with papers that use it).
            power_a: ``zoology`` only: the power law of the query gaps.
            random_non_queries: ``zoology`` only: random tokens instead of 0 at every non-query position.
            num_passes: ``zoology`` only: repetitions of the kv section (JRT).
        """
        super().__init__(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers, seed=seed)
        if format not in MQAR_FORMATS:
            raise ConfigError(f"data.format={format!r} is not an MQAR format; use one of {list(MQAR_FORMATS)}")
        self.format, self.power_a = format, power_a
        self.random_non_queries, self.num_passes = random_non_queries, num_passes
        counts = kv_pair_counts(num_kv_pairs)
        if format == "zoology":
            if num_queries is not None:
                raise ConfigError("data.num_queries must be null with format: zoology (every key is queried once)")
            for k in counts:  # the same checks as generation, on one throwaway example
                try:
                    make_mqar_zoology(1, vocab_size, seq_len, k, power_a, random_non_queries, num_passes,
                                      torch.Generator().manual_seed(0))
                except ConfigError as e:
                    raise ConfigError(f"data.{e}") from None
        else:
            for k in counts:
                _check_mqar(vocab_size, seq_len, k, num_queries)
        self.num_queries = num_queries
        self.vocab_size = vocab_size
        self.num_kv_pairs, self.kv_pair_counts = num_kv_pairs, counts
        self.train_examples = check_int("data.train_examples", train_examples, 1)
        self.val_examples = check_int("data.val_examples", val_examples, 1)
        self.save_hyperparameters()

    def _generate(self, n: int, seed: int) -> TensorPairDataset:
        """``n`` examples from one seed: an even split over :attr:`kv_pair_counts` (remainder to the first),
        concatenated then shuffled by the same generator."""
        g = torch.Generator().manual_seed(seed)
        counts = self.kv_pair_counts
        shares = [n // len(counts) + (i < n % len(counts)) for i in range(len(counts))]
        parts = [make_mqar_in_format(m, self.vocab_size, self.seq_len, k, self.format, self.num_queries,
                                     self.power_a, self.random_non_queries, self.num_passes, g)
                 for k, m in zip(counts, shares)]
        ids, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        if len(counts) > 1:
            order = torch.randperm(n, generator=g)
            ids, labels = ids[order], labels[order]
        return TensorPairDataset(ids, labels)

    def setup(self, stage: str | None = None) -> None:
        """Generate the train and val sets (once; later calls are no-ops)."""
        if self._datasets:
            return
        self._datasets = {
            "train": self._generate(self.train_examples, 2 * self.seed),
            "val": self._generate(self.val_examples, 2 * self.seed + 1),
        }
