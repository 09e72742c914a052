"""The word-order task on held-out text: sentences of the documents --split keeps out of
training, each beside a corrupted form (two adjacent words swapped, or every word
shuffled), and the evaluations a random encoder cannot win on it: zero-shot (does the
model's own pretraining head prefer the original?) and the frozen probe.

Zero-shot needs no labels, so nothing is learned from them: a random encoder is at 50% by
construction, and so is a model that learned only which words are frequent (a shuffle keeps
them). TACO: the pseudo-log-likelihood of the words under its MLM head (every 5th word
[MASK]ed per pass, 5 passes); SAS and ELECTRA: their RTD head (the mean log-probability
that each word is original: a shuffled sentence should look more replaced) and beside it
the MLM head's pseudo-log-likelihood."""

from __future__ import annotations

import numpy as np
import torch

from megatron_taco.data.indexed_dataset import IndexedDataset
from megatron_taco.data.samples import get_split_document_ranges
from megatron_taco.data.tokenizer import Tokenizer
from megatron_taco.evaluation.encoders import FrozenEncoder, pad_rows, token_rows
from megatron_taco.evaluation.probe import mean_pooled, probe

MASK_EVERY = 5  # zero-shot pseudo-log-likelihood: every 5th word [MASK]ed per pass
PROBE_SIZES = (32, 64, 128)  # labelled sentences the frozen probe trains on


def held_out_sentences(
    prefix: str, tokenizer: Tokenizer, split: str, parts: tuple[str, ...] = ("valid", "test")
) -> list[str]:
    """The sentences of 8-40 words (two distinct at least, no tab) of the validation and
    test documents of ``split``, or of those of ``parts`` only (a model selection on one,
    the figure on the other), decoded from the indexed dataset."""
    data = IndexedDataset(prefix)
    docs = data.document_indices
    _, valid, test = get_split_document_ranges(len(docs) - 1, split)
    ranges = {"valid": valid, "test": test}
    out = []
    for start, end in (ranges[part] for part in parts):
        for seq in range(int(docs[start]), int(docs[end])):
            text = " ".join(tokenizer.decode(data[seq]).split())
            words = text.split()
            # Two distinct words at least: shuffle_words looks for an order other than this one.
            if 8 <= len(words) <= 40 and len(set(words)) > 1 and "\t" not in text:
                out.append(text)
    return out


def clip_to_fit(tokenizer: Tokenizer, sentences: list[str], limit: int, min_words: int = 8):
    """Each sentence cut to its longest word prefix whose pieces, with [CLS] and [SEP], fit
    ``limit`` positions; those under ``min_words`` words dropped. Cut before any corruption,
    so a row and its corrupted form hold the same words: at a short sequence length most
    whole sentences do not fit (wiki at 32 positions: 74 of 600 validation sentences)."""
    out = []
    for sentence in sentences:
        words = sentence.split()
        for k in range(len(words), min_words - 1, -1):
            text = " ".join(words[:k])
            if len(tokenizer.encode(text)) + 2 <= limit:
                if len(set(words[:k])) > 1:
                    out.append(text)
                break
    return out


def swap_adjacent(sentence: str, rng: np.random.Generator) -> str:
    words = sentence.split()
    # Never a pair of equal words (the swap would change nothing).
    pairs = [i for i in range(len(words) - 1) if words[i] != words[i + 1]]
    i = int(rng.choice(pairs))
    words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def shuffle_words(sentence: str, rng: np.random.Generator) -> str:
    words = sentence.split()
    while True:  # any order but the original one
        order = rng.permutation(len(words))
        shuffled = [words[i] for i in order]
        if shuffled != words:
            return " ".join(shuffled)


CORRUPTIONS = {"swap": (swap_adjacent, "swapped"), "shuffle": (shuffle_words, "shuffled")}


def train_dev_rows(
    sentences: list[str], corruption: str, rng: np.random.Generator, both_forms: bool = False
) -> dict[str, list[tuple[str, str]]]:
    """{"train", "dev"}: (text, label) rows, a fifth of them dev. Each sentence once, as it
    is or corrupted, half and half; ``both_forms``: each sentence in both forms, the
    sentences (not the rows) split, so that no dev sentence is seen in training."""
    corrupt, label = CORRUPTIONS[corruption]
    if both_forms:
        order = rng.permutation(len(sentences))
        n_dev = len(sentences) // 5
        return {
            name: [
                row
                for i in idx
                for row in ((sentences[i], "original"), (corrupt(sentences[i], rng), label))
            ]
            for name, idx in (("dev", order[:n_dev]), ("train", order[n_dev:]))
        }
    rows = [(corrupt(s, rng), label) if i % 2 else (s, "original") for i, s in enumerate(sentences)]
    order = rng.permutation(len(rows))
    n_dev = len(rows) // 5
    return {"dev": [rows[i] for i in order[:n_dev]], "train": [rows[i] for i in order[n_dev:]]}


def fitting(tok: Tokenizer, sentences: list[str], seeds: int, limit: int):
    """(original rows, one list of shuffled rows per seed) of the sentences whose pieces, with
    [CLS] and [SEP], fit ``limit`` positions in every form: a cut sentence and its cut shuffle
    would hold different words, which the comparisons must not see."""
    shuffled = [
        [shuffle_words(s, np.random.default_rng(seed)) for s in sentences] for seed in range(seeds)
    ]
    forms = [token_rows(tok, sentences), *(token_rows(tok, f) for f in shuffled)]
    keep = [i for i in range(len(sentences)) if all(len(f[i]) <= limit for f in forms)]
    return [forms[0][i] for i in keep], [[f[i] for i in keep] for f in forms[1:]]


@torch.no_grad()
def originality_scores(
    enc: FrozenEncoder, rows: list[list[int]], tok: Tokenizer, head: str = "mlm", batch: int = 64
):
    """Higher = the model finds the sentence more like real text. ``head`` "mlm": the
    pseudo-log-likelihood per word from the MLM head (every 5th word [MASK]ed per pass);
    "rtd": the RTD head's mean log-probability that a token is original, log sigmoid(-z).
    Not the mean logit z: a head sure that the pieces inside a word are original (z of -7)
    outweighs, in a mean of logits, the one misplaced word it flags (+5), and a long-trained
    SAS then scored shuffles as more original (23% "zero-shot", measured)."""
    scores = np.zeros(len(rows))
    if head == "mlm":
        passes = [(i, j) for i in range(len(rows)) for j in range(MASK_EVERY)]
        for k in range(0, len(passes), batch):
            chunk = passes[k : k + batch]
            ids, mask, pos = pad_rows([rows[i] for i, _ in chunk], tok.pad_id)
            labels = torch.full_like(ids, -100)
            for r, (i, j) in enumerate(chunk):
                at = torch.arange(1 + j, len(rows[i]) - 1, MASK_EVERY)
                labels[r, at] = ids[r, at]
                ids[r, at] = tok.mask_id
            nll = enc.mlm_nll(ids, pos, mask, labels)
            owner = torch.tensor([i for i, _ in chunk]).unsqueeze(1).expand_as(labels)
            np.add.at(scores, owner[labels != -100].numpy(), -nll.numpy())
        return scores / np.array([max(len(r) - 2, 1) for r in rows])
    for k in range(0, len(rows), batch):
        ids, mask, _ = pad_rows(rows[k : k + batch], tok.pad_id)
        logits = enc.rtd_logits(ids, mask).double()
        words = mask.clone()
        words[:, 0] = False
        words &= ids != tok.sep_id
        not_replaced = torch.nn.functional.logsigmoid(-logits)
        scores[k : k + batch] = ((not_replaced * words).sum(1) / words.sum(1).clamp(min=1)).numpy()
    return scores


def zero_shot(original_scores: np.ndarray, shuffled_scores: np.ndarray) -> float:
    """The share of sentences whose original order the model prefers (ties count half)."""
    a, b = original_scores, shuffled_scores
    return float(np.mean((a > b) + 0.5 * (a == b)))


def word_order(encoders: list[FrozenEncoder], originals, shuffles, tok: Tokenizer):
    """({head: zero-shot scores}, {probe size: accuracies}) over the encoders and the seeds'
    shuffles (``fitting``'s rows); probes that need more sentences than there are are left
    out."""
    heads = encoders[0].heads
    zs = {head: [] for head in heads}
    probes = {n: [] for n in PROBE_SIZES if n <= len(originals) // 2}
    for enc in encoders:
        f_orig = mean_pooled(enc, originals, tok.pad_id)
        s_orig = {head: originality_scores(enc, originals, tok, head) for head in heads}
        for seed, shuffled in enumerate(shuffles):
            for head in heads:
                zs[head].append(
                    zero_shot(s_orig[head], originality_scores(enc, shuffled, tok, head))
                )
            f_shuf = mean_pooled(enc, shuffled, tok.pad_id)
            for n in probes:
                probes[n].append(probe(f_orig, f_shuf, n, seed))
    return zs, probes
