"""SQuAD v1.1/v2.0: the official evaluation scripts' scores on hand-made predictions (values
derived by hand below), answers' character offsets through sentencepiece, sliding windows and
max-context against loop references, n-best decoding, predictions files, bad input."""

import json
import re
import string
from collections import Counter

import numpy as np
import pytest

from megatron_taco.tasks import (
    TaskDataError,
    load_task,
    normalize_answer,
    squad_v1_evaluate,
    squad_v2_evaluate,
    write_squad_predictions,
)
from megatron_taco.tasks.squad import make_windows, max_context


def squad_json(paragraphs, version="1.1"):
    """paragraphs: [(context, [(qid, question, [(text, start)], is_impossible)])]."""
    data = [{"title": "T", "paragraphs": []}]
    for context, qas in paragraphs:
        entries = []
        for qid, question, answers, impossible in qas:
            qa = {
                "id": qid,
                "question": question,
                "answers": [{"text": t, "answer_start": s} for t, s in answers],
            }
            if version == "2.0":
                qa["is_impossible"] = impossible
            entries.append(qa)
        data[0]["paragraphs"].append({"context": context, "qas": entries})
    return {"version": version, "data": data}


def qa_with(context, answers):
    """(text, start) pairs located in the context."""
    return [(a, context.index(a)) for a in answers]


# ---------------------------------------------------------------------------------------
# the official scripts


def test_normalize_answer():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert normalize_answer("an apple, a pear and theatre") == "apple pear and theatre"
    assert normalize_answer("Levi's\tStadium") == "levis stadium"


V1_DATA = squad_json(
    [
        (
            "ctx",
            [
                ("q1", "Who?", [("the Denver Broncos", 0), ("Denver Broncos", 0)], False),
                ("q2", "Where?", [("Santa Clara, California", 0), ("Levi's Stadium", 0)], False),
                ("q3", "When?", [("1990", 0)], False),
                ("q4", "Why?", [("because", 0)], False),
                ("q5", "Which?", [("The", 0)], False),
            ],
        )
    ]
)["data"]


def test_squad_v1_official_scores():
    preds = {"q1": "Denver Broncos!", "q2": "Levi's Stadium in Santa Clara", "q3": "", "q5": "a"}
    # q1: both normalise to "denver broncos": EM 1, F1 1.
    # q2: prediction tokens [levis, stadium, in, santa, clara] (5). Against "santa clara
    #   california": 2 shared, P 2/5, R 2/3, F1 1/2; against "levis stadium": 2 shared, P 2/5,
    #   R 1, F1 4/7 -> max 4/7, EM 0.
    # q3: empty prediction: F1 0 (v1.1 has no empty-answer rule), EM 0.
    # q4: no prediction: 0, still counted in the total of 5.
    # q5: gold "The" and prediction "a" both normalise to "": EM 1, but F1 0 (no shared token;
    #   v2.0's rule would give 1).
    out = squad_v1_evaluate(V1_DATA, preds)
    assert out["exact_match"] == pytest.approx(100 * 2 / 5)
    assert out["f1"] == pytest.approx(100 * (1 + 4 / 7) / 5)


V2_DATA = squad_json(
    [
        (
            "ctx",
            [
                ("a1", "?", [("Normandy", 0), ("Normandy, France", 0)], False),
                ("a2", "?", [("10th and 11th centuries", 0)], False),
                ("a3", "?", [("Rollo", 0)], False),
                ("u1", "?", [], True),
                ("u2", "?", [], True),
            ],
        )
    ],
    version="2.0",
)["data"]
V2_PREDS = {"a1": "normandy", "a2": "in the 10th century", "a3": "", "u1": "", "u2": "the Franks"}
V2_NA = {"a1": 0.1, "a2": 0.2, "u2": 0.3, "u1": 0.8, "a3": 0.9}


def test_squad_v2_official_scores_and_best_threshold():
    # Raw scores. a1: EM 1, F1 1. a2: "in 10th century" (the article goes) vs "10th and 11th
    # centuries": one shared token, P 1/3, R 1/4, F1 2/7, EM 0. a3: empty prediction for an
    # answerable question: 0 and 0. u1: "" for unanswerable: 1 and 1. u2: an answer for an
    # unanswerable question: 0 and 0. No na_prob exceeds the default threshold 1.0.
    out = squad_v2_evaluate(V2_DATA, V2_PREDS, V2_NA)
    assert out["exact"] == pytest.approx(100 * 2 / 5)
    assert out["f1"] == pytest.approx(100 * (2 + 2 / 7) / 5)
    assert out["total"] == 5
    assert out["HasAns_exact"] == pytest.approx(100 / 3)
    assert out["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 7) / 3)
    assert out["HasAns_total"] == 3
    assert out["NoAns_exact"] == out["NoAns_f1"] == pytest.approx(50.0)
    assert out["NoAns_total"] == 2
    # Best threshold: start from "answer nothing" = 2 (the unanswerable questions), walk by
    # na_prob: a1 (0.1) +1 -> 3 (best, 0.1); a2 (0.2) +0 for EM -> 3 (not better); u2 (0.3)
    # answered -> -1; u1 0; a3 +0. best_exact = 3/5 at 0.1.
    assert out["best_exact"] == pytest.approx(60.0)
    assert out["best_exact_thresh"] == pytest.approx(0.1)
    # F1: a1 -> 3; a2 + 2/7 -> 23/7 (best, 0.2); u2 -1; ... best_f1 = (23/7)/5 at 0.2.
    assert out["best_f1"] == pytest.approx(100 * 23 / 7 / 5)
    assert out["best_f1_thresh"] == pytest.approx(0.2)


def test_squad_v2_drops_gold_answers_that_normalise_to_nothing():
    data = squad_json([("c", [("q", "?", [("The", 0), ("Rollo", 0)], False)])], "2.0")["data"]
    # gold answers are just ["Rollo"]: the question is answerable, "" and "a" score 0
    for pred in ("", "a"):
        out = squad_v2_evaluate(data, {"q": pred})
        assert out["exact"] == out["f1"] == 0.0 and out["HasAns_total"] == 1
    assert squad_v2_evaluate(data, {"q": "rollo"})["exact"] == 100.0


def test_squad_v2_na_prob_threshold_and_missing_predictions():
    # --na-prob-thresh 0.25: u2 (0.3), u1 (0.8) and a3 (0.9) become "no answer": u2 now scores
    # 1, u1 stays 1, a3 stays 0 -> exact 3/5, F1 (1 + 2/7 + 0 + 1 + 1) / 5
    out = squad_v2_evaluate(V2_DATA, V2_PREDS, V2_NA, na_prob_thresh=0.25)
    assert out["exact"] == pytest.approx(60.0)
    assert out["f1"] == pytest.approx(100 * (3 + 2 / 7) / 5)
    # without na_probs: no best_* keys; a missing prediction leaves the totals
    preds = {k: v for k, v in V2_PREDS.items() if k != "u2"}
    out = squad_v2_evaluate(V2_DATA, preds)
    assert "best_f1" not in out and out["total"] == 4
    assert out["exact"] == pytest.approx(100 * 2 / 4)
    # answering nothing being best keeps the threshold at 0.0
    wrong = {"a1": "x", "a2": "y", "a3": "z", "u1": "w", "u2": "v"}
    out = squad_v2_evaluate(V2_DATA, wrong, V2_NA)
    assert out["best_exact"] == pytest.approx(40.0) and out["best_exact_thresh"] == 0.0


# ---------------------------------------------------------------------------------------
# An independent transcription of the official evaluate-v2.0.py (its definitions, written
# here function by function in its own shape: nested normalisation steps, per-question loops,
# dict-based thresholding), to compare squad_v2_evaluate with on random datasets.


def official_normalize_answer(s):
    def remove_articles(text):
        return re.sub(re.compile(r"\b(a|an|the)\b", re.UNICODE), " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def official_get_tokens(s):
    if not s:
        return []
    return official_normalize_answer(s).split()


def official_compute_exact(a_gold, a_pred):
    return int(official_normalize_answer(a_gold) == official_normalize_answer(a_pred))


def official_compute_f1(a_gold, a_pred):
    gold_toks, pred_toks = official_get_tokens(a_gold), official_get_tokens(a_pred)
    num_same = sum((Counter(gold_toks) & Counter(pred_toks)).values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return int(gold_toks == pred_toks)  # no-answer on either side: 1 iff both
    if num_same == 0:
        return 0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def official_get_raw_scores(dataset, preds):
    exact_scores, f1_scores = {}, {}
    for article in dataset:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                qid = qa["id"]
                gold_answers = [
                    a["text"] for a in qa["answers"] if official_normalize_answer(a["text"])
                ]
                if not gold_answers:
                    gold_answers = [""]  # unanswerable: the only correct answer is ""
                if qid not in preds:
                    continue
                a_pred = preds[qid]
                exact_scores[qid] = max(official_compute_exact(a, a_pred) for a in gold_answers)
                f1_scores[qid] = max(official_compute_f1(a, a_pred) for a in gold_answers)
    return exact_scores, f1_scores


def official_apply_no_ans_threshold(scores, na_probs, qid_to_has_ans, na_prob_thresh):
    new_scores = {}
    for qid, s in scores.items():
        if na_probs[qid] > na_prob_thresh:
            new_scores[qid] = float(not qid_to_has_ans[qid])
        else:
            new_scores[qid] = s
    return new_scores


def official_make_eval_dict(exact_scores, f1_scores, qid_list=None):
    if not qid_list:
        total = len(exact_scores)
        return {
            "exact": 100.0 * sum(exact_scores.values()) / total,
            "f1": 100.0 * sum(f1_scores.values()) / total,
            "total": total,
        }
    total = len(qid_list)
    return {
        "exact": 100.0 * sum(exact_scores[k] for k in qid_list) / total,
        "f1": 100.0 * sum(f1_scores[k] for k in qid_list) / total,
        "total": total,
    }


def official_find_best_thresh(preds, scores, na_probs, qid_to_has_ans):
    num_no_ans = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    cur_score = best_score = num_no_ans
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        elif preds[qid]:
            diff = -1
        else:
            diff = 0
        cur_score += diff
        if cur_score > best_score:
            best_score, best_thresh = cur_score, na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def official_v2_main(dataset, preds, na_probs=None, na_prob_thresh=1.0, scored_only=False):
    """The script's main(). scored_only: HasAns/NoAns over the questions with a prediction
    (where the script raises KeyError; squad.py's one documented deviation)."""
    qid_to_has_ans = {
        qa["id"]: bool(qa["answers"]) for a in dataset for p in a["paragraphs"] for qa in p["qas"]
    }
    has_ans_qids = [k for k, v in qid_to_has_ans.items() if v]
    no_ans_qids = [k for k, v in qid_to_has_ans.items() if not v]
    if scored_only:
        has_ans_qids = [k for k in has_ans_qids if k in preds]
        no_ans_qids = [k for k in no_ans_qids if k in preds]
    exact_raw, f1_raw = official_get_raw_scores(dataset, preds)
    probs = na_probs if na_probs is not None else {k: 0.0 for k in preds}
    exact_thresh = official_apply_no_ans_threshold(exact_raw, probs, qid_to_has_ans, na_prob_thresh)
    f1_thresh = official_apply_no_ans_threshold(f1_raw, probs, qid_to_has_ans, na_prob_thresh)
    out = official_make_eval_dict(exact_thresh, f1_thresh)
    for prefix, qids in (("HasAns", has_ans_qids), ("NoAns", no_ans_qids)):
        if qids:
            part = official_make_eval_dict(exact_thresh, f1_thresh, qid_list=qids)
            out.update({f"{prefix}_{k}": v for k, v in part.items()})
    if na_probs is not None:
        out["best_exact"], out["best_exact_thresh"] = official_find_best_thresh(
            preds, exact_raw, na_probs, qid_to_has_ans
        )
        out["best_f1"], out["best_f1_thresh"] = official_find_best_thresh(
            preds, f1_raw, na_probs, qid_to_has_ans
        )
    return out


# words that normalisation changes: articles (alone and inside words), punctuation, case,
# hyphens and apostrophes that join words, non-ASCII letters
WORDS = [
    *("the", "a", "an", "The", "AN", "cat", "Cat", "dog", "dog's", "the-end", "theatre"),
    *("anne", "red", "Red", "blue", ",", ".", "!", "(1990s)", "Zoë", "café", "x-ray", "--"),
    *("end", "theend", "xray", "ray", "dogs", "s"),  # what the ones above may normalise to
]
NULLISH = ["the", "a", ".", "An !", "(the)", "", " "]  # normalise to ""


def _phrase(rng, lo=1, hi=5):
    words = rng.choice(WORDS, size=int(rng.integers(lo, hi)))
    seps = rng.choice([" ", "  ", "\t", " \n"], size=len(words))
    return "".join(w + s for w, s in zip(words, seps)).strip(" ") if len(words) else ""


def _random_squad(rng):
    """(dataset, predictions, na_probs or None, threshold): 1-12 questions in 1-3 paragraphs;
    unanswerable ones (no answers), answers that all normalise to "", empty and missing
    predictions, predictions that share some tokens, na_probs on a coarse grid (ties)."""
    data, preds, qids = [{"title": "t", "paragraphs": []}], {}, []
    for p in range(int(rng.integers(1, 4))):
        qas = []
        for q in range(int(rng.integers(1, 5))):
            qid = f"p{p}q{q}"
            kind = rng.random()
            if kind < 0.3:
                texts = []  # unanswerable
            elif kind < 0.4:
                texts = list(rng.choice(NULLISH, size=int(rng.integers(1, 3))))
            else:
                texts = [_phrase(rng) for _ in range(int(rng.integers(1, 4)))]
                if rng.random() < 0.2:
                    texts.append(str(rng.choice(NULLISH)))
            qas.append(
                {
                    "id": qid,
                    "question": "?",
                    "answers": [{"text": t, "answer_start": 0} for t in texts],
                }
            )
            qids.append(qid)
            r = rng.random()
            if r < 0.1:
                continue  # missing prediction
            if r < 0.35:
                preds[qid] = str(rng.choice(["", "", *NULLISH]))
            elif r < 0.6 and texts:
                gold = texts[int(rng.integers(len(texts)))]
                preds[qid] = str(
                    rng.choice(
                        [
                            gold.upper(),
                            f"the {gold}!",
                            re.sub(r"[-'(),.!]", " ", gold),  # punctuation as spaces
                            re.sub(r"[-'(),.!]", "", gold),
                        ]
                    )
                )
            else:
                preds[qid] = _phrase(rng)
        data[0]["paragraphs"].append({"context": "c", "qas": qas})
    if not preds:
        preds[qids[0]] = ""
    na_probs, thresh = None, 1.0
    if rng.random() < 0.75:
        grid = rng.random() < 0.5
        keys = qids if rng.random() < 0.5 else list(preds)  # the file may cover every question
        na_probs = {k: float(rng.integers(0, 5)) / 4 if grid else float(rng.normal()) for k in keys}
        thresh = float(rng.choice([1.0, 0.5, 0.0, -0.3]))
    elif rng.random() < 0.3:
        thresh = -0.5  # without a file every na_prob is 0.0: all become "no answer"
    return data, preds, na_probs, thresh


def test_squad_v2_evaluate_matches_the_official_script_on_random_data():
    rng = np.random.default_rng(20240601)
    seen = Counter()
    for _ in range(600):
        data, preds, na_probs, thresh = _random_squad(rng)
        ours = squad_v2_evaluate(data, preds, na_probs, na_prob_thresh=thresh)
        try:
            ref = official_v2_main(data, preds, na_probs, thresh)
        except KeyError:  # a prediction missing: the script fails in its HasAns/NoAns split
            ref = official_v2_main(data, preds, na_probs, thresh, scored_only=True)
            seen["missing"] += 1
        assert ours.keys() == ref.keys()
        for k, v in ref.items():
            assert ours[k] == pytest.approx(v, rel=1e-12, abs=1e-12), (k, data, preds, na_probs)
        for k in ("best_exact_thresh", "best_f1_thresh"):
            assert ours.get(k) == ref.get(k)  # a value of na_probs, exactly
        seen["na_probs"] += na_probs is not None
        seen["thresholded"] += any(
            v > thresh for v in (na_probs or dict.fromkeys(preds, 0.0)).values()
        )
        seen["partial_f1"] += any(0 < ref[k] < 100 for k in ("f1", "best_f1") if k in ref)
    # the random data exercised every branch (a changed generator must not hide one)
    assert min(seen.values()) >= 50, seen


# ---------------------------------------------------------------------------------------
# offsets, windows and decoding through load_task

CONTEXT = (
    "The  Café  Crème opened in São Paulo, Brazil (1990s);\tnaïve   critics said: "
    '"ｆｕｌｌ marks!"  Zoë  Ångström-Lee won.'
)
# accents, a doubled space inside the answer, NFKC-changed full-width letters, a tab,
# punctuation around answers, unknown pieces
ANSWERS = [
    *("Café  Crème", "São Paulo", "Brazil", "(1990s)", "1990s", "naïve   critics"),
    *('"ｆｕｌｌ marks!"', "Zoë  Ångström-Lee", "Lee", "won"),
]  # "1990s" and "Lee" follow a piece that ends where they start: "(" and "-"


def _write(tmp_path, name, doc):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")


def _peaked(features, n_rows=None):
    """Logits that put the maximum exactly on each feature's labelled start/end."""
    n, s = len(features), features.seq_length
    start = np.full((n, s), -10.0)
    end = np.full((n, s), -10.0)
    sp, ep = features.targets["start_positions"], features.targets["end_positions"]
    start[np.arange(n), sp] = 10.0
    end[np.arange(n), ep] = 10.0
    return {"start_logits": start, "end_logits": end}


def test_answers_map_through_sentencepiece_offsets_exactly(tmp_path, tokenizer):
    _answers_map_through_offsets_exactly(tmp_path, tokenizer)


def test_answers_map_through_wordpiece_offsets_exactly(tmp_path, wordpiece_vocab):
    from megatron_taco.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(wordpiece_vocab, "BertWordPieceLowerCase")
    _answers_map_through_offsets_exactly(tmp_path, tokenizer)


def _answers_map_through_offsets_exactly(tmp_path, tokenizer):
    qas = [(f"q{i}", f"question {i}?", qa_with(CONTEXT, [a]), False) for i, a in enumerate(ANSWERS)]
    doc = squad_json([(CONTEXT, qas)])
    _write(tmp_path, "train-v1.1.json", doc)
    _write(tmp_path, "dev-v1.1.json", doc)
    data = load_task("squad_v1", tmp_path, tokenizer, seq_length=128)
    assert data.stats["features"] == {"train": len(ANSWERS), "dev": len(ANSWERS)}
    assert data.stats["answer_not_in_pieces"]["train"] == 0
    ids, offsets = tokenizer.encode_with_offsets([CONTEXT])[0]
    for f in range(len(data.train)):
        item = data.train[f]
        s, e = item["start_positions"].item(), item["end_positions"].item()
        q = len(tokenizer.encode(f"question {f}?"))
        # the labelled tokens are the context's pieces, placed after [CLS] question [SEP]
        assert item["input_ids"][q + 2 : q + 2 + len(ids)].tolist() == ids.tolist()
        first, last = s - q - 2, e - q - 2
        text = CONTEXT[offsets[first, 0] : offsets[last, 1]].strip()
        assert text == ANSWERS[f]
    # decoding the labelled spans gives back the original characters, accents and spaces
    decoded = data.predict("dev", _peaked(data.dev["dev"]))
    assert decoded["predictions"] == {f"q{i}": a for i, a in enumerate(ANSWERS)}
    assert data.score("dev", _peaked(data.dev["dev"])) == {
        "exact": 100.0,
        "f1": 100.0,
        "total": len(ANSWERS),
    }


def test_offsets_match_the_byte_offsets_of_sentencepiece_protos(tokenizer):
    from megatron_taco.data.tokenizer import _char_offsets

    texts = [CONTEXT, "", "  lead  é\u0301 tab\there 漢字 end  ", "ﬁ ligature", "ａｂ"]
    protos = tokenizer._sp.encode(texts, out_type="proto")
    for text, (ids, off), proto in zip(texts, tokenizer.encode_with_offsets(texts), protos):
        assert ids.tolist() == tokenizer.encode(text)
        np.testing.assert_array_equal(off, _char_offsets(text, proto.pieces).reshape(-1, 2))
        # ordered, inside the text, and every non-space character is in exactly one piece
        assert (np.diff(off[:, 0]) >= 0).all() and (off[:, 1] >= off[:, 0]).all()
        covered = np.zeros(len(text), int)
        for b, e in off:
            covered[b:e] += 1
        assert all(covered[i] == 1 for i, ch in enumerate(text) if not ch.isspace())


def test_byte_offsets_round_to_characters():
    from types import SimpleNamespace as P

    from megatron_taco.data.tokenizer import _char_offsets

    # "aé漢b": bytes a | c3 a9 | e6 bc a2 | b. Byte-fallback pieces split "漢" into its three
    # bytes: each covers that whole character; an end inside a character rounds up.
    pieces = [P(begin=0, end=1), P(begin=1, end=3), P(begin=3, end=4), P(begin=4, end=5)]
    pieces += [P(begin=5, end=6), P(begin=6, end=7), P(begin=3, end=7)]
    assert _char_offsets("aé漢b", pieces).tolist() == [
        [0, 1],
        [1, 2],
        [2, 3],
        [2, 3],
        [2, 3],
        [3, 4],
        [2, 4],
    ]


def test_answer_not_on_piece_boundaries_takes_the_covering_pieces(tmp_path, tokenizer):
    # '!"' is one piece: the answer "marks!" ends inside it
    qas = [("q", "?", qa_with(CONTEXT, ["marks!"]), False)]
    _write(tmp_path, "train-v1.1.json", squad_json([(CONTEXT, qas)]))
    data = load_task("squad_v1", tmp_path, tokenizer, seq_length=128, splits=("train",))
    item = data.train[0]
    pieces = [
        tokenizer.id_to_piece(i)
        for i in item["input_ids"][item["start_positions"] : item["end_positions"] + 1]
    ]
    assert "".join(pieces).replace("▁", "") == 'marks!"'


def _bert_doc_spans(n_tokens, max_doc, stride):
    spans, start = [], 0
    while start < n_tokens:
        length = min(n_tokens - start, max_doc)
        spans.append((start, length))
        if start + length == n_tokens:
            break
        start += min(length, stride)
    return spans or [(0, 0)]


def _bert_is_max_context(spans, w, pos):
    best, best_score = None, None
    for i, (s, n) in enumerate(spans):
        if pos < s or pos > s + n - 1:
            continue
        score = min(pos - s, s + n - 1 - pos) + 0.01 * n
        if best_score is None or score > best_score:
            best, best_score = i, score
    return best == w


@pytest.mark.parametrize(
    ("n_tokens", "q_len", "seq", "stride"),
    [(50, 5, 24, 6), (17, 3, 20, 128), (60, 8, 30, 3), (0, 4, 16, 4), (19, 2, 24, 19)],
)
def test_windows_and_max_context_match_bert(n_tokens, q_len, seq, stride):
    win = make_windows(np.array([n_tokens]), np.array([q_len]), seq, stride)
    spans = _bert_doc_spans(n_tokens, seq - q_len - 3, stride)
    assert list(zip(win.doc_start.tolist(), win.doc_len.tolist())) == spans
    flags = max_context(win.doc_start, win.doc_len, n_tokens)
    for w, (s, n) in enumerate(spans):
        assert flags[w].tolist() == [_bert_is_max_context(spans, w, s + j) for j in range(n)]


def test_long_context_windows_and_labels(tmp_path, tokenizer):
    words = [f"w{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(40)]  # no digits: unknown
    context = " ".join(f"alpha {w} beta" for w in words)
    qas = [
        (f"q{i}", "which?", qa_with(context, [f"alpha {w} beta"]), False)
        for i, w in enumerate(words[::7])
    ]
    doc = squad_json([(context, qas)])
    _write(tmp_path, "train-v1.1.json", doc)
    _write(tmp_path, "dev-v1.1.json", doc)
    seq, stride = 32, 8
    data = load_task(
        "squad_v1", tmp_path, tokenizer, seq_length=seq, doc_stride=stride, max_query_length=4
    )
    ids, _ = tokenizer.encode_with_offsets([context])[0]
    q = tokenizer.encode("which?")[:4]
    spans = _bert_doc_spans(len(ids), seq - len(q) - 3, stride)
    assert len(data.train) == len(qas) * len(spans) == data.stats["features"]["train"]
    assert data.stats["truncated"]["train"] == (len(tokenizer.encode("which?")) > 4) * len(qas)
    for f in range(len(data.train)):
        item = data.train[f]
        s, n = spans[f % len(spans)]
        row = [2, *q, 3, *ids[s : s + n].tolist(), 3]
        assert item["input_ids"].tolist() == row + [0] * (seq - len(row))
        sp, ep = item["start_positions"].item(), item["end_positions"].item()
        if sp:  # answer inside this window: the pieces spell it
            text = tokenizer.decode(item["input_ids"][sp : ep + 1].tolist())
            assert text == f"alpha {words[::7][f // len(spans)]} beta"
        else:
            assert ep == 0
    assert data.stats["answer_outside_window"]["train"] > 0
    # dev: decoding equals a loop port of BERT's write_predictions, on logits peaked on the
    # labels and on random ones
    _, offsets = tokenizer.encode_with_offsets([context])[0]
    rng = np.random.default_rng(0)
    peaked = _peaked(data.dev["dev"])
    noisy = {k: rng.normal(size=v.shape) for k, v in peaked.items()}
    _write(tmp_path, "dev-v2.0.json", squad_json([(context, qas)], version="2.0"))
    v2 = load_task(
        "squad_v2",
        tmp_path,
        tokenizer,
        seq_length=seq,
        doc_stride=stride,
        max_query_length=4,
        splits=("dev",),
    )
    # [CLS] raised by 0..8 per question: some questions' null score wins
    per_question = np.repeat(np.linspace(0, 8, len(qas)), len(spans))
    shift = per_question[:, None] * (np.arange(seq) == 0)
    null_some = {k: v + shift for k, v in noisy.items()}
    for logits in (peaked, noisy, null_some):
        expect, expect_v2, odds = {}, {}, {}
        for i in range(len(qas)):
            feats = [
                (
                    logits["start_logits"][i * len(spans) + w],
                    logits["end_logits"][i * len(spans) + w],
                )
                for w in range(len(spans))
            ]
            text, score = _bert_prediction(feats, spans, len(q) + 2, context, offsets, 20, 30)
            expect[f"q{i}"] = text
            # v2: the null score is the smallest [CLS] score over the windows
            null = min(st[0] + en[0] for st, en in feats)
            odds[f"q{i}"] = pytest.approx(null - score)
            expect_v2[f"q{i}"] = "" if null - score > 0 else text
        assert data.predict("dev", logits)["predictions"] == expect
        decoded = v2.predict("dev", logits)
        assert decoded["predictions"] == expect_v2 and decoded["null_odds"] == odds
    assert set(expect.values()) != {""}
    # the shifted [CLS] logits make some answers null and leave others
    assert "" in expect_v2.values() and len(set(expect_v2.values())) > 1


def _bert_prediction(feats, spans, c0, context, offsets, n_best, max_len):
    """BERT's run_squad write_predictions for one question, in plain loops: the best non-null
    (text, start + end logit)."""
    prelim = []
    for w, (start, end) in enumerate(feats):
        top_s = sorted(range(len(start)), key=lambda i: -start[i])[:n_best]
        top_e = sorted(range(len(end)), key=lambda i: -end[i])[:n_best]
        s0, n = spans[w]
        for i in top_s:
            for j in top_e:
                if not (c0 <= i < c0 + n and c0 <= j < c0 + n):
                    continue  # not in the context part of the row
                if not _bert_is_max_context(spans, w, s0 + i - c0):
                    continue
                if j < i or j - i + 1 > max_len:
                    continue
                prelim.append((start[i] + end[j], s0 + i - c0, s0 + j - c0))
    prelim.sort(key=lambda x: -x[0])
    for score, a, b in prelim:
        text = context[offsets[a][0] : offsets[b][1]].strip()
        if text:
            return text, score
    return "", -np.inf


def test_decoding_rules(tmp_path, tokenizer):
    context = "you said that his one was not there but they"  # one piece per word
    qas = [("q", "who?", qa_with(context, ["that"]), False)]
    _write(tmp_path, "dev-v1.1.json", squad_json([(context, qas)]))
    data = load_task(
        "squad_v1",
        tmp_path,
        tokenizer,
        seq_length=64,
        max_answer_length=3,
        n_best_size=5,
        splits=("dev",),
    )
    ids, off = tokenizer.encode_with_offsets([context])[0]
    c0 = len(tokenizer.encode("who?")) + 2  # row position of the first context token
    tok = {context[b:e].strip(): c0 + i for i, (b, e) in enumerate(off)}
    start = np.full((1, 64), -5.0)
    end = np.full((1, 64), -5.0)
    start[0, 1] = end[0, 1] = 9.0  # the question's first token: never an answer
    assert len(tok) == len(ids) == 10
    start[0, tok["said"]] = 8.0
    end[0, tok["but"]] = 7.9  # "said ... but": longer than max_answer_length 3
    end[0, tok["his"]] = 2.0  # "said that his": 3 tokens
    end[0, tok["one"]] = 3.0  # "said that his one": 4 tokens, one too many
    start[0, tok["not"]] = 1.0
    end[0, tok["you"]] = 6.0  # ends before any start
    out = data.predict("dev", {"start_logits": start, "end_logits": end})
    assert out["predictions"] == {"q": "said that his"}
    nbest = out["nbest"]["q"]
    # candidates: starts among the 5 best (said 8, not 1, then question/[CLS] positions), ends
    # among the 5 best (but 7.9, you 6, one 3, his 2, ...): "said that his" 8 + 2 and "not there
    # but" 1 + 7.9 are valid; "said ... but" and "said ... one" are too long, anything ending at
    # "you" ends too early
    assert [c["text"] for c in nbest] == ["said that his", "not there but"]
    assert sum(c["probability"] for c in nbest) == pytest.approx(1.0)
    assert nbest[1]["probability"] == pytest.approx(1 / (1 + np.exp(10 - 8.9)))
    assert nbest[0]["start_logit"] + nbest[0]["end_logit"] == pytest.approx(10.0)


def test_squad_v2_null_odds_and_files(tmp_path, tokenizer):
    context = "alpha beta gamma delta"
    qas = [("has", "b?", qa_with(context, ["beta"]), False), ("none", "z?", [], True)]
    doc = squad_json([(context, qas)], version="2.0")
    _write(tmp_path, "dev-v2.0.json", doc)
    data = load_task("squad_v2", tmp_path, tokenizer, seq_length=32, splits=("dev",))
    feats = data.dev["dev"]
    assert [feats[i]["start_positions"].item() for i in range(2)][1] == 0  # impossible -> [CLS]
    logits = _peaked(feats)
    # question "has": span score 10 + 10 = 20, null (position 0) -10 + -10 -> odds -40
    # question "none": its span is [CLS] itself (labels 0, 0): null 20; best non-null span
    # takes the next highest logits (-10 + -10 = -20) -> odds 40 > 0 -> ""
    out = data.predict("dev", logits)
    assert out["predictions"] == {"has": "beta", "none": ""}
    assert out["null_odds"]["has"] == pytest.approx(-40.0)
    assert out["null_odds"]["none"] == pytest.approx(40.0)
    scores = data.score("dev", logits)
    assert scores["exact"] == scores["HasAns_exact"] == scores["NoAns_exact"] == 100.0
    # best threshold: start at 1 (one unanswerable), "has" (odds -40) +1 -> 2 at -40
    assert scores["best_f1"] == 100.0 and scores["best_f1_thresh"] == pytest.approx(-40.0)
    written = write_squad_predictions(tmp_path / "out", out)
    assert [p.rsplit("/", 1)[1] for p in written] == [
        "predictions.json",
        "null_odds.json",
        "nbest_predictions.json",
    ]
    preds = json.loads((tmp_path / "out" / "predictions.json").read_text())
    odds = json.loads((tmp_path / "out" / "null_odds.json").read_text())
    # the files written are the official script's inputs: its transcription above, run on
    # them, gives the task's scores
    assert scores == pytest.approx(official_v2_main(doc["data"], preds, odds))


def test_bad_squad_files_name_file_and_record(tmp_path, tokenizer):
    with pytest.raises(TaskDataError, match=r"train-v1\.1\.json: missing"):
        load_task("squad_v1", tmp_path, tokenizer, seq_length=64)
    (tmp_path / "train-v1.1.json").write_text('{"data": [\n{"paragraphs": [}\n]}')
    with pytest.raises(TaskDataError, match=r"train-v1\.1\.json:2:\d+: not valid JSON"):
        load_task("squad_v1", tmp_path, tokenizer, seq_length=64, splits=("train",))
    doc = squad_json(
        [("ctx here", [("id1", "q?", [("ctx", 0)], False), ("id2", "q?", [("x", 0)], False)])]
    )
    del doc["data"][0]["paragraphs"][0]["qas"][1]["question"]
    _write(tmp_path, "train-v1.1.json", doc)
    with pytest.raises(
        TaskDataError, match=r"data\[0\]\.paragraphs\[0\]\.qas\[1\] \(id id2\): missing 'question'"
    ):
        load_task("squad_v1", tmp_path, tokenizer, seq_length=64, splits=("train",))
    # a training answer that is not at its answer_start is counted and skipped, as BERT does
    doc = squad_json(
        [("ctx here", [("id1", "q?", [("ctx", 0)], False), ("id2", "q?", [("here", 0)], False)])]
    )
    _write(tmp_path, "train-v1.1.json", doc)
    data = load_task("squad_v1", tmp_path, tokenizer, seq_length=64, splits=("train",))
    assert data.stats["skipped"]["train"] == {"answer_not_at_answer_start": 1}
    assert len(data.train) == 1


def test_a_dev_question_id_is_used_once(tmp_path, tokenizer):
    """The dev predictions are keyed by question id (predictions.json, the official scripts):
    a repeated id would score one question's answer for both. Training ids are never looked
    up, so a repeat there is harmless."""
    doc = squad_json([("alpha beta", [("a", "b?", [("beta", 6)], False)]),
                      ("gamma delta", [("a", "g?", [("delta", 6)], False)])])  # fmt: skip
    _write(tmp_path, "dev-v1.1.json", doc)
    with pytest.raises(
        TaskDataError,
        match=r"dev-v1\.1\.json: data\[0\]\.paragraphs\[1\]\.qas\[0\]: id 'a' repeats "
        r"data\[0\]\.paragraphs\[0\]\.qas\[0\]; predictions are keyed by id",
    ):
        load_task("squad_v1", tmp_path, tokenizer, seq_length=32, splits=("dev",))
    _write(tmp_path, "train-v1.1.json", doc)
    assert (
        len(load_task("squad_v1", tmp_path, tokenizer, seq_length=32, splits=("train",)).train) == 2
    )


@pytest.mark.parametrize("value", [True, False, "12", 1.0, None])
def test_answer_start_must_be_a_json_integer(tmp_path, tokenizer, value):
    """A JSON true is an int to Python (it would read as 1); strings, floats and null are
    no offsets either: one line naming the file and the answer."""
    doc = squad_json([("alpha beta", [("a", "b?", [("beta", 6)], False)])])
    doc["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = value
    _write(tmp_path, "dev-v1.1.json", doc)
    with pytest.raises(
        TaskDataError,
        match=rf"dev-v1\.1\.json: data\[0\]\.paragraphs\[0\]\.qas\[0\] \(id a\)\.answers\[0\]: "
        rf"'answer_start' is {re.escape(json.dumps(value))} \({type(value).__name__}\), "
        "expected int$",
    ):
        load_task("squad_v1", tmp_path, tokenizer, seq_length=32, splits=("dev",))


def test_question_too_long_for_seq_length_names_the_question_and_the_fix(tmp_path, tokenizer):
    long_q = "why did the red kite fly over the park on sunday morning?"
    doc = squad_json(
        [("ctx here", [("id1", "q?", [("ctx", 0)], False), ("id2", long_q, [("ctx", 0)], False)])]
    )
    _write(tmp_path, "train-v1.1.json", doc)
    n = len(tokenizer.encode(long_q))
    assert n > len(tokenizer.encode("q?")) and n > 5
    # n question tokens + [CLS] [SEP] [SEP] + one context token
    message = (
        rf"train-v1\.1\.json: question id id2 has {n} tokens \(kept by --max-query-length 64\).*"
        rf"--seq-length {n + 2}; use --seq-length {n + 4} or more, or --max-query-length "
        rf"{n - 2} or less"
    )
    with pytest.raises(TaskDataError, match=message):
        load_task("squad_v1", tmp_path, tokenizer, seq_length=n + 2, splits=("train",))
    # the smallest workable values named in the message do work
    for kwargs in ({"seq_length": n + 4}, {"seq_length": n + 2, "max_query_length": n - 2}):
        data = load_task("squad_v1", tmp_path, tokenizer, splits=("train",), **kwargs)
        assert data.stats["examples"]["train"] == 2
    with pytest.raises(TaskDataError, match=r"use --seq-length \d+ or more;?$"):
        load_task("squad_v1", tmp_path, tokenizer, seq_length=4, splits=("train",))


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None, []])
def test_is_impossible_must_be_a_json_boolean(tmp_path, tokenizer, value):
    qas = [("has", "b?", [("beta", 6)], False), ("odd", "z?", [("alpha", 0)], False)]
    doc = squad_json([("alpha beta", qas)], version="2.0")
    doc["data"][0]["paragraphs"][0]["qas"][1]["is_impossible"] = value
    for name in ("train-v2.0.json", "dev-v2.0.json"):
        _write(tmp_path, name, doc)
    with pytest.raises(
        TaskDataError,
        match=rf"train-v2\.0\.json: data\[0\]\.paragraphs\[0\]\.qas\[1\] \(id odd\): "
        rf"'is_impossible' is {re.escape(repr(value))} \({type(value).__name__}\), expected "
        "true or false",
    ):
        load_task("squad_v2", tmp_path, tokenizer, seq_length=32)
    # JSON booleans, and no key (answerable iff it has answers), load
    doc["data"][0]["paragraphs"][0]["qas"][1]["is_impossible"] = False
    del doc["data"][0]["paragraphs"][0]["qas"][0]["is_impossible"]
    for name in ("train-v2.0.json", "dev-v2.0.json"):
        _write(tmp_path, name, doc)
    data = load_task("squad_v2", tmp_path, tokenizer, seq_length=32)
    assert [data.train[i]["start_positions"].item() > 0 for i in range(2)] == [True, True]
